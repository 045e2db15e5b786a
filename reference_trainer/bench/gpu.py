"""``tracetop bench gpu --out DIR [--cpu] [--json]``: the GPU path, proved in one device call.

Seven parts, each in processes of its own, each with a time limit inside one budget
(``--budget-s``, default 480 s). A part that fails or runs out of time is recorded in the JSON
with its error, its figures' keys set to null, and the next part runs. Writes two files into DIR:
``gpu.json`` (every figure; rewritten after each part, so a run cut short keeps what it had) and
``gpu.log`` (the tail of every process's output).

1. ``sync`` (``reference_trainer/bench/gpu_child.py sync``): the reference trainer's model in a
   sync-free bf16 loop, gradients all-reduced over an NCCL group of one process (NCCL refuses two
   ranks on one GPU, so collectives run as a group of one), under
   ``torch.cuda.set_sync_debug_mode("error")``: a control without hooks, then the hooks (CUDA
   events, collectives wrapped, the emitter resolving and shipping meanwhile). Zero syncs added
   by the hooks = the hooks ran without an error and every step came back. The DeepSpeed run of
   part 2 adds ``deepspeed_warn_mode``: the same trainer under "warn", each synchronization
   attributed to its innermost frame outside torch (DeepSpeed and the trainer's ``float(loss)``
   synchronize by design, so "error" cannot run them).
1b. ``ddp`` (``gpu_child ddp``): DDP's gradient buckets on CUDA events (issue 9): a plain
   ``DistributedDataParallel`` model of several buckets over an NCCL group of one under
   ``set_sync_debug_mode("error")``, a control without hooks, then the Tracer finding the DDP
   module and timing its buckets through the comm hook; bucket rows and their bytes against the
   gradient bytes, durations against their steps', the steps' device time against the loop's
   host wall clock, and that only the emitter asked the events.
2. ``overhead`` (``gpu_child hooks``, which runs ``reference_trainer/bench/hooks_child.py``): the
   larger preset (``1b``) on DeepSpeed, bf16, hooks switched on and off every 2 steps in random
   ABBA/BAAB quads, as ``tracetop bench hooks`` does; the figure is the wall step time (the
   median over quads of on - off, goal <= 0.2%; ``meets_goal`` is true when its whole 95% interval
   is at or below the goal, false when all of it is above, null when it straddles), beside the CPU-time figures of ``bench hooks``
   and the host cost per recorded event (CPU path and CUDA-event path).
3. ``timing``, from the same run (one 1b run serves both, to fit the budget): per "on" step,
   (data wait + forward + backward + optimizer + exposed comm) / step duration from the CUDA
   events, and that duration / the trainer's own host wall time of the step (train_batch ends in
   a device sync), within ``tolerance_pct`` (5% on GPU, 20% on CPU) of 1; and which threads asked
   the device clock about events (only ``tracetop-emitter`` may).
4. ``nvml`` (``agent/bench/gpu.py agent``): the agent against the real NVML for 30 s.
5. ``offload`` (``gpu_child offload`` + ``agent/bench/gpu.py pcie``): the ZeRO shape
   (``--zero 2 --offload cpu``, 350m, bf16) while another process samples NVML's PCIe counters;
   the hooks' d2h/h2d bytes and GB/s over the measured steps against NVML's TX/RX over the same
   wall-clock window (goal: within 10%).
6. ``loop`` (a collector of its own with ``--controller auto`` + the reference trainer under
   torchrun; issue 11's offload must-show): ZeRO-1 at micro-batch 1 (the smallest allowed) with an
   activation-like pressure of ``A`` MiB a sample freed every step, against a declared budget of
   ``A`` MiB, which the step's peak exceeds whatever the rest weighs (weights alone are more than
   nothing). The controller, at the smallest micro-batch, turns optimizer offload on; recorded:
   the action and its step on every rank (the ranks' reports and the trainer's own per-rank logs),
   the OFFLOAD rows before and after that step, and the step peak (MEMORY rows) over the steps
   before and after it: on a GPU the device peak falls by the optimizer state (or the pressure,
   whichever is smaller); on CPU the peak is the host's, where the state moved to, so
   ``memory_fell`` is null with a note. One rank on a GPU (NCCL refuses two on one device), two on CPU.

``--cpu``: the same parts end to end on CPU with small sizes (gloo, the fake NVML, perf_counter;
part 3 through the hooks' GPU accounting path with a host clock, so the emitter resolves), for the
test suite; figures that only a GPU can give say "not applicable" instead of passing.

Layering: this module imports no agent or collector (and torch only to see that a GPU is there); it
starts the parts as processes
(``python -m reference_trainer.bench.gpu_child``, ``python -m agent.bench.gpu``,
``python -m collector``), so each part imports only what its own package may.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tracetop.errors import TracetopError

SCHEMA = 1
JSON_NAME, LOG_NAME = "gpu.json", "gpu.log"
GOAL_OVERHEAD_PCT = 0.2
GOAL_OFFLOAD_PCT = 10.0

#: part -> the figures it always carries (null when the part failed or does not apply).
FIGURES: dict[str, tuple[str, ...]] = {
    "sync": ("applicable", "mode", "backend", "model", "dtype", "steps", "collectives_per_step", "micro_batch_step_ms",
             "control_passed",
             "control_error", "hooks_passed", "hooks_error", "hook_errors", "syncs_added_by_hooks", "step_rows", "step_rows_under_check",
             "collective_rows", "resolved_by_threads", "verdict", "deepspeed_warn_mode"),
    "ddp": ("applicable", "mode", "backend", "model", "steps", "control_passed", "control_error", "hooks_passed",
            "hooks_error", "hook_errors", "syncs_added_by_hooks", "timed_by_comm_hook", "grad_bytes", "bucket_rows",
            "step_rows", "step_rows_under_check", "buckets_per_step", "bucket_bytes_per_step", "bytes_match",
            "bucket_ms_median", "bucket_ms_max", "bucket_over_step_max", "exposed_ms_median", "steps_device_s",
            "loop_wall_s", "steps_over_wall", "resolved_by_threads", "emitter_resolves", "verdict"),
    "overhead": ("model", "steps", "block_steps", "quads", "off_step_ms", "overhead_wall_pct",
                 "overhead_wall_ci95_low_pct", "overhead_wall_ci95_high_pct", "goal_pct", "meets_goal",
                 "overhead_cpu_pct", "training_thread_pct", "hook_threads_upper_pct", "hook_us_per_step",
                 "hook_threads_ms_per_s", "ns_per_event_cpu_path", "ns_per_event_cpu_path_p90",
                 "ns_per_event_cuda_path"),
    "timing": ("timer", "steps_compared", "tolerance_pct", "phase_sum_over_step_median", "phase_sum_over_step_min",
               "phase_sum_over_step_max", "step_over_wall_median", "step_over_wall_min", "step_over_wall_max",
               "collectives_per_step", "within_tolerance", "resolved_by_threads", "resolved_on_training_thread",
               "emitter_resolves"),
    "nvml": ("backend", "duration_s", "passes", "driver_version", "gpus", "fields_read", "fields_null",
             "unsupported_calls", "sample_ms_per_pass", "sample_cpu_ms_per_pass", "xid_watcher_up",
             "xid_registered_gpus", "agent_cpu_pct", "collector_connected"),
    "offload": ("shape", "model", "dtype", "steps", "window_s", "hooks_d2h_bytes", "hooks_h2d_bytes",
                "hooks_d2h_gbps", "hooks_h2d_gbps", "hooks_whats", "nvml_backend", "nvml_source", "nvml_tx_bytes",
                "nvml_rx_bytes", "nvml_tx_gbps", "nvml_rx_gbps", "d2h_vs_tx_pct", "h2d_vs_rx_pct", "goal_pct",
                "within_goal"),
    "loop": ("model", "ranks", "micro_batch", "activation_mb_per_sample", "budget_mb", "memory_source",
             "offload_action", "offload_state", "offload_step", "offload_on_every_rank_at_one_step",
             "trainer_offloaded_from_step", "offload_rows_before", "offload_rows_after", "offload_bytes_after",
             "peak_mb_before", "peak_mb_after", "memory_fell", "memory_note", "over_budget_after",
             "actions", "cannot_fix", "verdict"),
}
PARTS = ("sync", "ddp", "overhead", "nvml", "offload", "loop")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for gpu.json and gpu.log (created)")
    p.add_argument("--cpu", action="store_true",
                   help="run every part on CPU with small sizes (gloo, fake NVML): the test suite's mode")
    p.add_argument("--json", action="store_true", help="print the JSON at the end")
    p.add_argument("--budget-s", type=float, default=None, help="time budget of the whole (default 480; --cpu 360)")
    p.add_argument("--model", default=None, help="preset of parts 1-3 (default 1b; --cpu tiny)")
    p.add_argument("--offload-model", default=None, help="preset of part 5 (default 350m; --cpu tiny)")
    p.add_argument("--steps", type=int, default=None, help="steps of the overhead run (default 400; --cpu 96)")
    p.add_argument("--nvml-s", type=float, default=None, help="seconds of the agent part (default 30; --cpu 3)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma-separated parts to run (timing comes with overhead); default all")
    p.add_argument("--keep", default=None, help="keep the temporary files (collector db, raw logs) in this folder")


# ----------------------------------------------------------------------------- pure figures


def wall_overhead(quads_on: list[float], quads_off: list[float], resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """Median over quads of (on - off) wall seconds per step, in % of an off step, with a
    bootstrap 95% interval (pure but for the seeded resampling)."""
    import numpy as np

    d = np.array(quads_on) - np.array(quads_off)
    base = float(np.mean(quads_off))
    rng = np.random.default_rng(seed)
    boot = np.median(d[rng.integers(0, len(d), (resamples, len(d)))], axis=1) / base * 100
    return {"overhead_wall_pct": float(np.median(d)) / base * 100,
            "overhead_wall_ci95_low_pct": float(np.percentile(boot, 2.5)),
            "overhead_wall_ci95_high_pct": float(np.percentile(boot, 97.5)),
            "off_step_ms": base * 1e3}


def goal_verdict(low_pct: float, high_pct: float, goal_pct: float) -> bool | None:
    """True when the whole 95% interval lies at or below the goal, False when all of it lies
    above, None when it straddles the goal (undecided: more quads needed) (pure)."""
    if high_pct <= goal_pct:
        return True
    if low_pct > goal_pct:
        return False
    return None


def counter_at(samples: list[tuple[int, float]], t_ns: int) -> float | None:
    """A cumulative counter at t_ns, linearly interpolated between the samples around it (pure);
    None outside the samples."""
    if not samples or t_ns < samples[0][0] or t_ns > samples[-1][0]:
        return None
    for (ta, va), (tb, vb) in zip(samples, samples[1:]):
        if ta <= t_ns <= tb:
            return va if tb == ta else va + (vb - va) * (t_ns - ta) / (tb - ta)
    return samples[-1][1]


def throughput_bytes(samples: list[tuple[int, float]], t0_ns: int, t1_ns: int, unit_bytes: int = 1024) -> float | None:
    """Bytes over [t0, t1] from rate readings (units of unit_bytes per second), each held from its
    time to the next reading's (pure); None when the readings do not cover the window."""
    if len(samples) < 2 or samples[0][0] > t0_ns or samples[-1][0] < t1_ns:
        return None
    total = 0.0
    for (ta, rate), (tb, _) in zip(samples, samples[1:]):
        lo, hi = max(ta, t0_ns), min(tb, t1_ns)
        if hi > lo:
            total += rate * unit_bytes * (hi - lo) / 1e9
    return total


def offload_figures(trainer: dict[str, Any], pcie: dict[str, Any]) -> dict[str, Any]:
    """Part 5 (pure): the hooks' offload bytes per direction over the trainer's window against
    NVML's PCIe TX (device -> host: d2h) and RX (host -> device: h2d) over the same window:
    cumulative counters where the GPU has them, else the throughput readings integrated."""
    t0, t1 = trainer.get("window_start_ns"), trainer.get("window_end_ns")
    if not t0 or not t1 or t1 <= t0:
        raise ValueError(f"offload: the trainer gave no measured window ({t0}..{t1}); raise --steps above the warmup")
    window_s = (t1 - t0) / 1e9
    by = trainer.get("by_direction", {})
    d2h = by.get("d2h", {}).get("bytes", 0)
    h2d = by.get("h2d", {}).get("bytes", 0)
    rows = pcie.get("samples", [])
    tx_c = [(r[0], float(r[1])) for r in rows if r[1] is not None]
    rx_c = [(r[0], float(r[2])) for r in rows if r[2] is not None]
    source, tx, rx = None, None, None
    a, b = counter_at(tx_c, t0), counter_at(tx_c, t1)
    c, d = counter_at(rx_c, t0), counter_at(rx_c, t1)
    if None not in (a, b, c, d) and b >= a and d >= c:  # type: ignore[operator]  (a counter that wrapped: next)
        source, tx, rx = "counters (NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES)", b - a, d - c  # type: ignore[operator]
    else:
        tx_t = throughput_bytes([(r[0], float(r[3])) for r in rows if r[3] is not None], t0, t1)
        rx_t = throughput_bytes([(r[0], float(r[4])) for r in rows if r[4] is not None], t0, t1)
        if tx_t is not None and rx_t is not None:
            source, tx, rx = "throughput (nvmlDeviceGetPcieThroughput, KB/s integrated)", tx_t, rx_t

    def pct(hooks: float, nvml: float | None) -> float | None:
        return None if not nvml else (hooks - nvml) / nvml * 100

    d2h_pct, h2d_pct = pct(d2h, tx), pct(h2d, rx)
    within = None if d2h_pct is None or h2d_pct is None else (abs(d2h_pct) <= GOAL_OFFLOAD_PCT and
                                                               abs(h2d_pct) <= GOAL_OFFLOAD_PCT)
    return {
        "steps": trainer.get("steps"), "window_s": window_s,
        "hooks_d2h_bytes": d2h, "hooks_h2d_bytes": h2d,
        "hooks_d2h_gbps": d2h / window_s / 1e9, "hooks_h2d_gbps": h2d / window_s / 1e9,
        "hooks_whats": trainer.get("whats"), "hooks_by_direction": by,
        "nvml_backend": pcie.get("backend"), "nvml_source": source, "nvml_samples": len(rows),
        "nvml_tx_bytes": tx, "nvml_rx_bytes": rx,
        "nvml_tx_gbps": None if tx is None else tx / window_s / 1e9,
        "nvml_rx_gbps": None if rx is None else rx / window_s / 1e9,
        "d2h_vs_tx_pct": d2h_pct, "h2d_vs_rx_pct": h2d_pct, "goal_pct": GOAL_OFFLOAD_PCT, "within_goal": within,
        "nvml_unsupported_calls": pcie.get("unsupported_calls", []),
        "note": ("the fake NVML's counters do not move: the comparison needs a GPU" if pcie.get("backend") == "fake"
                 else None),
    }


def loop_figures(actions: list[dict], ranks: list[dict], offload: list[dict], memory: list[dict],
                 rank_logs: dict[int, list[dict]], *, world: int, budget_bytes: int, on_gpu: bool,
                 window: int = 10) -> dict[str, Any]:
    """Part 6 (pure): from the loop collector's `actions`, `action_ranks`, OFFLOAD and MEMORY rows
    and the trainer's per-rank logs. ``offload`` rows: (rank, step, direction, what, bytes);
    ``memory`` rows: (rank, step, peak_bytes). The peak is compared as the median over ranks'
    steps in the ``window`` steps before the offload step against the ``window`` after it (the
    step itself left out: the command applies at its boundary)."""
    on = [a for a in actions if a["kind"] == "offload" and a["value"] == 1]
    act = on[0] if on else None
    step = act["step"] if act and act["state"] in ("applied", "verified", "rolled_back") else None
    applied = [r for r in ranks if act and r["action_id"] == act["action_id"] and r["stage"] == "applied"]
    every = bool(act) and step is not None and sorted(r["rank"] for r in applied) == list(range(world)) \
        and {r["step"] for r in applied} == {step}
    first_off = {rank: next((r["step"] for r in rows if r.get("offloaded_states")), None)
                 for rank, rows in sorted(rank_logs.items())}
    if step is None:
        before = after = []
        rows_before = rows_after = bytes_after = None
    else:
        before = [m["peak_bytes"] for m in memory if step - window <= m["step"] < step and m["peak_bytes"] >= 0]
        after = [m["peak_bytes"] for m in memory if step < m["step"] <= step + window and m["peak_bytes"] >= 0]
        # the boundary of step S follows step S-1: the first offload_states is in step S-1's rows
        rows_before = sum(1 for o in offload if o["step"] < step - 1)
        rows_after = sum(1 for o in offload if o["step"] >= step - 1)
        bytes_after = {}
        for o in offload:
            if o["step"] >= step - 1:
                k = f"{o['direction']}:{o['what']}"
                bytes_after[k] = bytes_after.get(k, 0) + int(o["bytes"])
    mb0 = statistics.median(before) / 2**20 if before else None
    mb1 = statistics.median(after) / 2**20 if after else None
    fell = (mb1 < mb0) if on_gpu and mb0 is not None and mb1 is not None else None
    note = None if on_gpu else ("CPU: the step peak is the host's resident memory, and offload moves the optimizer "
                                "state to the host, so it cannot fall here; the fall needs a GPU's device memory")
    cannot = [a for a in actions if a["state"] == "cannot_fix"]
    checks = {"offload on at one step on every rank": every,
              "the trainer's logs agree": bool(first_off) and len(set(first_off.values())) == 1
              and None not in first_off.values(),
              "OFFLOAD rows only from that step": rows_before == 0 and bool(rows_after)}
    if on_gpu:
        checks["device memory fell"] = bool(fell)
    failed = [k for k, ok in checks.items() if not ok]
    return {
        "offload_action": act and {k: act.get(k) for k in ("action_id", "rule", "reason", "proposed_by", "approved_by",
                                                             "ranks_applied", "ranks_expected", "outcome",
                                                             "verification")},
        "offload_state": act and act["state"], "offload_step": step, "offload_on_every_rank_at_one_step": every,
        "trainer_offloaded_from_step": {str(k): v for k, v in first_off.items()},
        "offload_rows_before": rows_before, "offload_rows_after": rows_after, "offload_bytes_after": bytes_after,
        "peak_mb_before": mb0, "peak_mb_after": mb1, "memory_fell": fell, "memory_note": note,
        "over_budget_after": None if mb1 is None else mb1 * 2**20 > budget_bytes,
        "actions": [(a["action_id"], a["kind"], a["value"], a["state"], a["rule"]) for a in actions],
        "cannot_fix": cannot[0]["reason"] if cannot else None,
        "verdict": "passed: " + "; ".join(checks) if not failed else "FAILED: " + "; ".join(failed),
        "checks_failed": failed,
    }


# ----------------------------------------------------------------------------- the driver


class PartFailed(TracetopError, RuntimeError):
    pass


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.cpu = bool(args.cpu)
        self.out = Path(args.out)
        self.budget_s = float(args.budget_s or (360 if self.cpu else 480))
        self.model = args.model or ("tiny" if self.cpu else "1b")
        self.offload_model = args.offload_model or ("tiny" if self.cpu else "350m")
        self.steps = int(args.steps or (96 if self.cpu else 400))
        self.steps_given = args.steps is not None
        self.overhead_limit_s = 180.0 if self.cpu else 300.0
        self.nvml_s = float(args.nvml_s if args.nvml_s is not None else (3 if self.cpu else 30))
        self.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
        self.keep = args.keep
        self.tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tracetop-bench-gpu-"))
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.log_lines: list[str] = []
        self.result: dict[str, Any] = {
            "schema": SCHEMA, "mode": "cpu" if self.cpu else "gpu", "ok": None, "budget_s": self.budget_s,
            "started_unix_s": round(time.time(), 3), "load_before": _loadavg(), "nproc": os.cpu_count(),
            "collector": {"address": None, "error": None},
            "parts": {name: {"ok": None, "error": "not run", "wall_s": 0.0, **dict.fromkeys(keys)}
                      for name, keys in FIGURES.items()},
        }
        self.endpoint = "127.0.0.1:1"  # nothing listens: used when the collector cannot start

    # ---- bookkeeping ----
    def remaining_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def log(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.t0:7.1f}s] "
        self.log_lines.append(stamp + line)
        print(stamp + line, file=sys.stderr, flush=True)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.result["wall_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / (JSON_NAME + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.out / JSON_NAME)
        (self.out / LOG_NAME).write_text("\n".join(self.log_lines[-4000:]) + "\n")

    def env(self, run_id: str) -> dict[str, str]:
        e = dict(os.environ, PYTHONUNBUFFERED="1", TRACETOP_ENDPOINT=self.endpoint, TRACETOP_RUN_ID=run_id)
        e.pop("TRACETOP_DISABLE", None)
        if self.cpu:
            e.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        else:
            e["DS_ACCELERATOR"] = "cuda"  # make exports cpu; and the carried DeepSpeed wheel was built on a CPU machine
        e.setdefault("DS_BUILD_OPS", "0")
        return e

    def spawn(self, name: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
              until: Any = None, linger_s: float = 0.0) -> None:
        """Run one process of a part, its output to the log; raise PartFailed on failure or timeout.
        ``until``: checked every second; once true, the process gets ``linger_s`` more seconds
        and is then asked to stop (SIGTERM; torchrun passes it to its workers): done, not failed."""
        timeout_s = max(1.0, min(timeout_s, self.remaining_s()))
        raw = self.tmp / f"{name}.out"
        self.log(f"{name}: {' '.join(argv[1:])} (limit {timeout_s:.0f} s)")
        stopped = False
        with open(raw, "w") as f:
            # not a session of its own: if this driver is killed (the device call's limit), its parts go too
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env or self.env(f"bench-gpu-{name}"))
            deadline = time.monotonic() + timeout_s
            rc = None
            try:
                while until is not None and proc.poll() is None and time.monotonic() < deadline:
                    if until():
                        time.sleep(linger_s)
                        if proc.poll() is None:
                            self.log(f"{name}: the evidence is in; stopping the run")
                            stopped = True
                            proc.terminate()
                        break
                    time.sleep(1.0)
                rc = proc.wait(max(1.0, deadline - time.monotonic()) if not stopped else 60)
            except subprocess.TimeoutExpired:
                _kill(proc)
                rc = None
        if stopped and rc is not None:
            rc = 0
        lines = raw.read_text(errors="replace").splitlines()
        keep = 150
        if len(lines) > keep:
            self.log_lines.append(f"  ... {len(lines) - keep} earlier lines of {name} left out")
        self.log_lines += ["  | " + ln[:400] for ln in lines[-keep:]]
        if rc is None:
            raise PartFailed(f"{name}: still running after {timeout_s:.0f} s (the part's limit or the budget); stopped")
        if rc != 0:
            tail = " / ".join(ln.strip() for ln in lines[-3:])
            raise PartFailed(f"{name}: exited {rc}: {tail[-600:]}")

    def run_part(self, name: str, fn: Any, min_s: float) -> None:
        part = self.result["parts"][name]
        if name not in self.parts and not (name == "timing" and "overhead" in self.parts):
            part["error"] = "not asked for (--parts)"
            return
        if self.remaining_s() < min_s:
            part.update(ok=False, error=f"skipped: {self.remaining_s():.0f} s of the budget left, the part needs {min_s:.0f}")
            self.log(f"{name}: {part['error']}")
            self.save()
            return
        t = time.monotonic()
        try:
            figures = fn()
            failed = figures.pop("_failed", None)  # a part that ran but failed its check keeps its figures
            part.update(figures)
            part.update(ok=failed is None, error=failed)
        except Exception as e:
            part.update(ok=False, error=f"{type(e).__name__}: {e}" if not isinstance(e, PartFailed) else str(e))
            self.log(f"{name}: FAILED: {part['error']}")
        part["wall_s"] = round(time.monotonic() - t, 1)
        self.log(f"{name}: done in {part['wall_s']} s, ok={part['ok']}")
        self.save()

    # ---- the parts ----
    def part_sync(self) -> dict[str, Any]:
        out = self.tmp / "sync.json"
        argv = [sys.executable, "-m", "reference_trainer.bench.gpu_child", "sync", str(out), "--model", self.model,
                "--steps", "4" if self.cpu else "8", "--micro-batch", "2", *(["--cpu"] if self.cpu else [])]
        self.spawn("sync", argv, 120 if self.cpu else 150)
        figures = json.loads(out.read_text())
        self.size_overhead_run(figures.get("micro_batch_step_ms"))
        return figures

    def part_ddp(self) -> dict[str, Any]:
        out = self.tmp / "ddp.json"
        argv = [sys.executable, "-m", "reference_trainer.bench.gpu_child", "ddp", str(out), "--steps", "8",
                *(["--cpu"] if self.cpu else [])]
        self.spawn("ddp", argv, 90)
        figures = json.loads(out.read_text())
        if not (figures.get("rehearsal_ok") if self.cpu else figures.get("hooks_passed")):
            # failed, its figures kept (they say why)
            figures["_failed"] = (f"ddp: {figures.get('verdict')} (hooks_error={figures.get('hooks_error')}, "
                                  f"bytes_match={figures.get('bytes_match')}, emitter_resolves={figures.get('emitter_resolves')})")
        return figures

    def size_overhead_run(self, micro_batch_step_ms: float | None) -> None:
        """Fewer steps for the overhead run when the sync part's plain loop says that 400 would not
        fit its limit (a DeepSpeed step of 4 micro-batches ~ 4.5 plain one-micro-batch steps,
        plus ~90 s of start-up); never below 96 (12 quads), never when --steps was given."""
        if self.cpu or self.steps_given or not micro_batch_step_ms:
            return
        per_step_s = 4.5 * micro_batch_step_ms / 1e3
        fit = int((self.overhead_limit_s - 90) / per_step_s)
        if fit < self.steps:
            self.steps = max(96, fit - fit % 8)
            self.log(f"overhead: {self.steps} steps (a plain micro-batch step took {micro_batch_step_ms:.0f} ms)")

    def part_overhead(self) -> dict[str, Any]:
        """Parts 2 and 3 from one run; fills 'timing' and the sync part's warn-mode figures too."""
        from reference_trainer.bench import hooks as hooks_bench

        out = self.tmp / "hooks.json"
        block, warmup = 2, 16
        trainer = ["--steps", str(self.steps), "--model", self.model, "--micro-batch", "2", "--micro-batches", "4",
                   "--quiet", "--micro-blocks", "8" if self.cpu else "40", *(["--cpu"] if self.cpu else [])]
        argv = [sys.executable, "-m", "reference_trainer.bench.gpu_child", "hooks", str(out), str(block), str(warmup),
                "1", *trainer]
        self.spawn("overhead", argv, self.overhead_limit_s)
        log = json.loads(out.read_text())
        extra = json.loads(out.with_suffix(".extra.json").read_text())
        quads = hooks_bench.block_quads(log)
        if not quads.thread_on:
            raise PartFailed("overhead: no complete quad of on/off blocks; raise --steps")
        cpu = hooks_bench.estimate([quads])
        figures: dict[str, Any] = {
            "model": self.model, "steps": self.steps, "block_steps": block, "quads": cpu["quads"],
            **wall_overhead(quads.wall_on, quads.wall_off),
            "goal_pct": GOAL_OVERHEAD_PCT,
            "overhead_cpu_pct": cpu["overhead_pct"], "training_thread_pct": cpu["training_thread_pct"],
            "hook_threads_upper_pct": cpu["hook_threads_upper_pct"],
            "hook_us_per_step": statistics.median(a - b for a, b in zip(quads.thread_on, quads.thread_off)) * 1e6,
            "hook_threads_ms_per_s": hooks_bench.hook_thread_rates([log.get("window") or {}]),
            **extra["events"],
        }
        figures["meets_goal"] = goal_verdict(figures["overhead_wall_ci95_low_pct"], figures["overhead_wall_ci95_high_pct"],
                                             GOAL_OVERHEAD_PCT)
        timing = self.result["parts"]["timing"]
        timing.update(extra["timing"], ok=True, error=None)
        timing["ok"] = True
        self.result["parts"]["sync"]["deepspeed_warn_mode"] = extra["syncs"]
        return figures

    def part_nvml(self) -> dict[str, Any]:
        out = self.tmp / "nvml.json"
        argv = [sys.executable, "-m", "agent.bench.gpu", "agent", str(out), "--duration-s", str(self.nvml_s),
                "--collector", self.endpoint, *(["--fake"] if self.cpu else [])]
        self.spawn("nvml", argv, self.nvml_s + 60)
        return json.loads(out.read_text())

    def part_offload(self) -> dict[str, Any]:
        pcie_out, trainer_out = self.tmp / "pcie.json", self.tmp / "offload.json"
        warmup = 2
        steps = 6 if self.cpu else 10
        sampler_log = self.tmp / "pcie.out"
        with open(sampler_log, "w") as err:
            sampler = subprocess.Popen(
                [sys.executable, "-m", "agent.bench.gpu", "pcie", str(pcie_out), *(["--fake"] if self.cpu else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env=self.env("bench-gpu-pcie"))
        try:
            assert sampler.stdout is not None and sampler.stdin is not None
            first = sampler.stdout.readline().strip()  # "ready" after the first sample, or EOF if it died
            if first != "ready":
                sampler.wait(10)
                raise PartFailed(f"offload: the NVML sampler did not start: {first} "
                                 f"{sampler_log.read_text(errors='replace')[-600:]}")
            dtype = "fp32" if self.cpu else "bf16"
            argv = [sys.executable, "-m", "reference_trainer.bench.gpu_child", "offload", str(trainer_out), str(warmup),
                    "--pp", "1", "--zero", "2", "--offload", "cpu", "--model", self.offload_model, "--steps", str(steps),
                    "--micro-batch", "2", "--micro-batches", "2", "--dtype", dtype, "--quiet"]
            self.spawn("offload", argv, 150 if self.cpu else 240)
        finally:
            if sampler.stdin is not None:
                sampler.stdin.close()
            try:
                sampler.wait(30)
            except subprocess.TimeoutExpired:
                _kill(sampler)
            self.log_lines += ["  | pcie: " + ln[:400] for ln in sampler_log.read_text(errors="replace").splitlines()[-30:]]
        figures = offload_figures(json.loads(trainer_out.read_text()), json.loads(pcie_out.read_text()))
        figures.update(shape="ZeRO-2, optimizer offload to cpu, pp 1", model=self.offload_model, dtype=dtype)
        return figures

    def part_loop(self) -> dict[str, Any]:
        """Part 6: the auto loop's offload on a budget the smallest micro-batch still exceeds."""
        from tracetop import procs

        folder = self.tmp / "loop"
        folder.mkdir(exist_ok=True)
        ranks, model = (2, "tiny") if self.cpu else (1, "350m")
        # steps of peak compared on each side of the offload step (CPU: fewer, each offloaded step
        # there spends seconds in DeepSpeed's offload_states / reload_states)
        window = 3 if self.cpu else 10
        act_mb = 16 if self.cpu else 2048
        toml = folder / "controller.toml"
        # offload slows the step by its copies; the verification is not what is shown here
        toml.write_text("[controller]\ntick_s = 0.5\ncooldown_s = 1\ncooldown_steps = 3\nverify_steps = 4\n"
                        "min_micro_batch = 1\nmax_throughput_drop = 0.95\n")
        db = folder / "loop.duckdb"
        col = procs.collector(db, "127.0.0.1:0", extra_args=["--controller", "auto", "--controller-config", str(toml),
                                                              "--flush-interval-s", "0.2"])
        try:
            col.start(60)
        except procs.ServiceError as e:
            raise PartFailed(f"loop: the collector did not start: {e}") from None
        run_id = "bench-gpu-loop"
        env = self.env(run_id)
        env.update(TRACETOP_ENDPOINT=col.address, TRACETOP_FLUSH_S="0.5", TRACETOP_COMMAND_EVERY_STEPS="2",
                   TRACETOP_COMMAND_POLL_S="0.5")
        # every rank 50 ms slower (alike: no straggler), so the run outlasts the controller's tick in wall time
        slow = [a for r in range(ranks) for a in ("--inject-straggler", f"{r}:50")]
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                "-m", "reference_trainer", "--quiet", "--rank-log-dir", str(folder / "ranks"), "--pp", "1", "--zero", "1",
                "--model", model, "--dtype", "fp32" if self.cpu else "bf16", "--micro-batch", "1", "--micro-batches", "2",
                "--steps", "400", "--activation-mb-per-sample", str(act_mb), "--memory-budget-mb", str(act_mb), *slow]
        rank_dir = folder / "ranks"

        def logs() -> dict[int, list[dict]]:
            out = {}
            for p in sorted(rank_dir.glob("rank*.jsonl")):
                text = p.read_text(errors="replace")
                out[int(p.stem[4:])] = [json.loads(x) for x in text.splitlines()[:text.count("\n")] if x.strip()]
            return out

        def enough() -> bool:
            """Every rank's own log shows offload on and ``window`` + the verification's 4 steps + 2 after it."""
            got = logs()
            if len(got) < ranks:
                return False
            for rows in got.values():
                first = next((r["step"] for r in rows if r.get("offloaded_states")), None)
                if first is None or rows[-1]["step"] < first + window + 6:
                    return False
            return True

        try:
            # the run is long enough for any machine's load; it is stopped once its logs hold the evidence
            # (its rows ship every 0.5 s: a few seconds more, and the collector has them)
            self.spawn("loop", argv, 150, env=env, until=enough, linger_s=4.0)
        finally:
            try:
                col.stop(timeout_s=60)
            except Exception:
                col.kill()

        def rows(sql: str) -> list[dict]:
            r = subprocess.run([sys.executable, "-m", "tracetop.cli", "query", str(db), sql, "--json"],
                               capture_output=True, text=True, timeout=60, env=self.env("bench-gpu-query"))
            if r.returncode != 0:
                raise PartFailed(f"loop: query failed: {r.stderr[-600:]}")
            return json.loads(r.stdout or "[]")

        where = f"WHERE run_id = '{run_id}'"
        figures = loop_figures(
            rows(f"SELECT * FROM actions {where} ORDER BY try_cast(action_id AS INT)"),
            rows(f"SELECT action_id, rank, stage, step FROM action_ranks {where}"),
            rows(f"SELECT rank, step, direction, what, bytes FROM offload {where}"),
            rows(f"SELECT rank, step, peak_bytes FROM memory {where}"),
            logs(), world=ranks, budget_bytes=act_mb * 2**20, on_gpu=not self.cpu, window=window)
        figures.update(model=model, ranks=ranks, micro_batch=1, activation_mb_per_sample=act_mb, budget_mb=act_mb,
                       memory_source="host resident memory (step peak)" if self.cpu
                       else "device max_memory_allocated (step peak)")
        if figures["checks_failed"]:
            raise PartFailed(f"loop: {figures['verdict']}; actions {figures['actions']}")
        return figures

    # ---- the whole ----
    def start_collector(self) -> Any:
        from reference_trainer.bench.hooks import BenchCollector

        try:
            c = BenchCollector(self.tmp)
            self.endpoint = c.addr
            self.result["collector"]["address"] = c.addr
            self.log(f"collector: listening on {c.addr}")
            return c
        except Exception as e:  # the parts still run: their rows go nowhere (kept in memory, dropped at exit)
            self.result["collector"]["error"] = f"{type(e).__name__}: {e}"[:800]
            self.log(f"collector: could not start ({e}); parts ship to {self.endpoint}, where nothing listens")
            return None

    def run(self) -> dict[str, Any]:
        self.log(f"tracetop bench gpu: mode {self.result['mode']}, budget {self.budget_s:.0f} s, model {self.model}, "
                 f"offload model {self.offload_model}, load {self.result['load_before']}")
        self.save()
        collector = self.start_collector()
        try:
            self.run_part("sync", self.part_sync, 20)
            self.run_part("ddp", self.part_ddp, 20)
            self.run_part("overhead", self.part_overhead, 40)
            self.run_part("nvml", self.part_nvml, self.nvml_s + 10)
            self.run_part("offload", self.part_offload, 30)
            self.run_part("loop", self.part_loop, 45)
        finally:
            if collector is not None:
                collector.stop()
            timing = self.result["parts"]["timing"]
            over = self.result["parts"]["overhead"]
            if timing["ok"] is None:
                timing.update(ok=over["ok"], error=over["error"] if not over["ok"] else None, wall_s=0.0)
                if over["ok"] is None:
                    timing["error"] = over["error"]
            asked = [p for p in FIGURES if p in self.parts or (p == "timing" and "overhead" in self.parts)]
            self.result["ok"] = all(self.result["parts"][p]["ok"] for p in asked)
            self.result["load_after"] = _loadavg()
            self.save()
            if not self.keep:
                shutil.rmtree(self.tmp, ignore_errors=True)
        return self.result


def _kill(proc: subprocess.Popen) -> None:
    """Our own child, by its pid (the parts start no processes of their own)."""
    proc.kill()
    proc.wait(10)


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "?"


def run(args: argparse.Namespace) -> int:
    unknown = [p for p in args.parts.split(",") if p.strip() and p.strip() not in PARTS]
    if unknown:
        print(f"tracetop bench gpu: unknown part(s) {', '.join(unknown)}; use {', '.join(PARTS)} "
              "(timing comes with overhead)", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"tracetop bench gpu: --out {out} is a file; give a folder (it is created)", file=sys.stderr)
        return 2
    if not args.cpu:
        try:
            import torch

            if not torch.cuda.is_available():
                print("tracetop bench gpu: no CUDA device here; run with --cpu for the CPU rehearsal", file=sys.stderr)
                return 2
        except ImportError:
            print("tracetop bench gpu: torch is not installed (pip install torch first)", file=sys.stderr)
            return 2
    result = Bench(args).run()
    if args.json:
        print(json.dumps(result, default=str))
    else:
        for name, part in result["parts"].items():
            state = "ok" if part["ok"] else "not run" if part["ok"] is None else f"FAILED ({part['error']})"
            print(f"{name}: {state}")
        print(f"figures in {out / JSON_NAME}, log in {out / LOG_NAME}")
    return 0 if result["ok"] else 1
