"""The trainer-side parts of ``tracetop bench gpu`` (``reference_trainer/bench/gpu.py``), one process each.

``python -m reference_trainer.bench.gpu_child MODE OUT.json ...``, MODE one of:

* ``sync OUT --model M --steps N --micro-batch B [--cpu]``: part 1, strict. The reference
  trainer's model (``reference_trainer.model.GPT``) in a plain PyTorch loop (bf16 weights, torch
  AdamW, the gradients all-reduced over a process group of one: NCCL on GPU, gloo on CPU) with
  every batch on the device beforehand, so the loop itself never synchronizes. Under
  ``torch.cuda.set_sync_debug_mode("error")``: first N steps without hooks (the control: it
  shows the loop is sync-free, else the check is inconclusive and says so), then the hooks
  (``trainer_hooks.Tracer``, CUDA events, collectives wrapped) are created and run N steps with
  phases, and the emitter resolves, drains and beats for a while, all still under "error". A
  synchronization inside a hook raises there, the Tracer counts it (``errors``); one in the
  emitter likewise (``hook_error_sites`` says where). Should the control itself synchronize (torch
  changes), the hooks' run falls back to "warn" with each sync attributed (see ``sync_site``), and
  ``mode`` says so. On CPU there is nothing to check: the figures say so.
* ``hooks OUT BLOCK WARMUP SEED <trainer flags>``: parts 2 and 3, and part 1 on the real trainer.
  ``reference_trainer.bench.hooks_child`` runs the reference trainer (DeepSpeed) with the hooks switched
  on and off every BLOCK steps, as ``tracetop bench hooks`` does (OUT gets its per-step log);
  around it this module tees the hooks' STEP and COLLECTIVE rows, watches which threads ask the
  device clock about events (``ready``/``elapsed_ns``), and on GPU runs the trainer under
  ``set_sync_debug_mode("warn")`` with every "synchronizing CUDA operation" warning attributed to
  the innermost frame outside torch (a file of ``trainer_hooks/`` or a hook thread: the hooks';
  DeepSpeed's and the trainer's own ``float(loss)`` are theirs), counted per on and off step. DeepSpeed
  and the trainer synchronize by design, so "error" cannot run them; the warn mode counts instead.
  On CPU (``--cpu``) the tracer gets a ``HostClock`` (perf_counter behind the device-clock
  interface), which puts it on its GPU accounting path: the emitter resolves every event.
  Then a microbenchmark of the host cost per recorded event (CPU path: ``reference_trainer.bench.hooks``'s;
  and on GPU the CUDA-event path). OUT.extra.json gets these figures.
* ``ddp OUT --steps N [--cpu]``: DDP's gradient buckets on the GPU path (issue 9). A plain
  ``DistributedDataParallel`` model (several buckets) over a process group of one (NCCL on GPU:
  it refuses two ranks on one GPU; a group of one still runs DDP's reducer and its comm hook;
  gloo on CPU), every batch on the device beforehand, under ``set_sync_debug_mode("error")``: N
  steps without hooks (the control), then the Tracer (CUDA events; the DDP module found at its
  first forward and its buckets timed through the comm hook) for N steps, with the emitter
  resolving meanwhile. Figures: bucket rows per step and their bytes against the model's gradient
  bytes, bucket durations against their step's, the steps' device time against the host wall
  clock of the loop (bracketed by synchronizations outside the check), and which threads asked
  the device clock (only ``tracetop-emitter`` may). On CPU the same code runs with the Tracer's
  own ``CudaClock`` over host events (``trainer_hooks.device_clock.HostClock``).
* ``offload OUT WARMUP <trainer flags>``: part 5's trainer side, the ZeRO shape with optimizer
  offload: the hooks' OFFLOAD rows of the steps from WARMUP on and the wall-clock window
  (``time.time_ns``) they span, for comparison with NVML's PCIe counters sampled meanwhile by
  ``agent/bench/gpu.py`` in another process.

Layering: this module imports the reference trainer and trainer_hooks only (DESIGN §2).
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from tracetop.events import Kind
from trainer_hooks.device_clock import HostClock

SYNC_MESSAGE = "synchronizing CUDA operation"


class WatchedClock:
    """A device clock that notes which thread asks about events (``ready``/``elapsed_ns``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked: collections.Counter[str] = collections.Counter()

    def mark(self) -> Any:
        return self.inner.mark()

    def ready(self, ev: Any) -> bool:
        self.asked[threading.current_thread().name] += 1
        return self.inner.ready(ev)

    def elapsed_ns(self, a: Any, b: Any) -> int:
        self.asked[threading.current_thread().name] += 1
        return self.inner.elapsed_ns(a, b)

    def release(self, a: Any, b: Any) -> None:
        self.inner.release(a, b)

    def memory(self) -> tuple[int, int, int]:
        return self.inner.memory()


class Tee:
    """Copies of the rows a Tracer hands its shipper: STEP and COLLECTIVE (from the emitter's
    ``record_many``) and OFFLOAD (from ``record``), kept as plain lists."""

    def __init__(self, host_clock: bool = False) -> None:
        self.host_clock = host_clock  # no GPU: give the tracer a HostClock (the deferred path on CPU)
        self.steps: list[dict[str, int]] = []
        self.collectives: list[tuple[int, int, int, str]] = []  # (step, duration_ns, bytes, op)
        self.offloads: list[tuple[int, str, str, int, int]] = []  # (step, direction, what, bytes, duration_ns)
        self.clocks: list[WatchedClock] = []

    def attach(self, tracer: Any) -> None:
        shipper = tracer.shipper
        record_many, record = shipper.record_many, tracer.recorder.record

        def tee_many(kind: Any, cols: dict[str, Any]) -> Any:
            try:
                if kind == Kind.STEP:
                    keys = ("step", "start_ns", "duration_ns", "data_wait_ns", "forward_ns", "backward_ns",
                            "optimizer_ns", "comm_exposed_ns")
                    for row in zip(*(cols[k].tolist() for k in keys)):
                        self.steps.append(dict(zip(keys, row)))
                elif kind == Kind.COLLECTIVE:
                    codes, names = cols["op"]
                    self.collectives += list(zip(cols["step"].tolist(), cols["duration_ns"].tolist(),
                                                 cols["bytes"].tolist(), [names[c] for c in codes.tolist()]))
            except Exception as e:  # the tee must not change what the hooks do
                print(f"reference_trainer.bench.gpu_child: tee failed: {e!r}", file=sys.stderr)
            return record_many(kind, cols)

        def tee_one(kind: Any, *row: Any) -> Any:
            if kind == Kind.OFFLOAD:
                _, step, _, duration_ns, direction, what, nbytes = row
                self.offloads.append((int(step), str(direction), str(what), int(nbytes), int(duration_ns)))
            return record(kind, *row)

        shipper.record_many = tee_many
        rec = tracer.recorder
        rec.record = tee_one
        if rec.device_clock is None and self.host_clock:
            rec.device_clock = HostClock()
        if rec.device_clock is not None:
            clock = WatchedClock(rec.device_clock)
            rec.device_clock = clock
            self.clocks.append(clock)

    def resolved_by(self) -> dict[str, int]:
        total: collections.Counter[str] = collections.Counter()
        for c in self.clocks:
            total.update(c.asked)
        return dict(total)


def _patch_trainer(tee: Tee, step_times: dict[int, int], window: dict[str, int]) -> None:
    """Tee every tracer the trainer starts; note the wall clock when each step's batch is made
    (after the previous step, which ended in the trainer's float(loss), i.e. a device sync) and
    when tracing closes (right after the last step)."""
    from reference_trainer import data as data_mod
    from reference_trainer import tracing as tracing_mod

    real_start, real_batches = tracing_mod.start, data_mod.micro_batches_for

    def start(engine: Any, args: Any, *, meta: dict[str, Any]) -> Any:
        traced = real_start(engine, args, meta=meta)
        tracer = getattr(traced, "tracer", None)
        if tracer is not None:
            tee.attach(tracer)
            real_close = traced.close

            def close() -> None:
                window.setdefault("closed_ns", time.time_ns())
                real_close()

            traced.close = close
        return traced

    def batches(step: int, *a: Any, **kw: Any) -> Any:
        step_times[int(step)] = time.time_ns()
        window["current_step"] = int(step)
        return real_batches(step, *a, **kw)

    tracing_mod.start = start
    data_mod.micro_batches_for = batches


# ----------------------------------------------------------------------------- sync attribution


def sync_site(stack: list[traceback.FrameSummary], thread: str) -> tuple[str, str]:
    """(owner, "file:line function") of a synchronization: the innermost frame outside torch and
    this module. Owner "hooks" for a file of trainer_hooks/ or a hook thread (tracetop-*), else
    "deepspeed", "trainer" (reference_trainer/) or "other"."""
    for fr in reversed(stack):
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or f.endswith(("warnings.py", "gpu_child.py")) or "/importlib/" in f:
            continue
        short = "/".join(f.split("/")[-2:])
        site = f"{short}:{fr.lineno} {fr.name}"
        if "/trainer_hooks/" in f or thread.startswith("tracetop"):
            return "hooks", site
        if "/deepspeed/" in f:
            return "deepspeed", site
        if "/reference_trainer/" in f and "/tests/" not in f:
            return "trainer", site
        return "other", site
    return ("hooks" if thread.startswith("tracetop") else "other"), "?"


class SyncWatch:
    """torch.cuda.set_sync_debug_mode("warn"), each warning attributed (see sync_site) and
    counted by the step in progress."""

    def __init__(self, window: dict[str, int], set_mode: Any = None) -> None:
        self.window = window
        self.records: list[tuple[int, str, str]] = []  # (step, owner, site)
        self._lock = threading.Lock()
        self._set_mode = set_mode
        self._previous: Any = None

    def start(self) -> None:
        import warnings

        if self._set_mode is None:
            import torch

            self._set_mode = torch.cuda.set_sync_debug_mode
        previous = self._previous = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if SYNC_MESSAGE in str(message):
                thread = threading.current_thread().name
                owner, site = sync_site(traceback.extract_stack()[:-1], thread)
                with self._lock:
                    self.records.append((self.window.get("current_step", -1), owner, site))
                return
            previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}.*")
        self._set_mode("warn")

    def stop(self) -> None:
        import warnings

        self._set_mode(0)
        if self._previous is not None:
            warnings.showwarning = self._previous


def sync_figures(records: list[tuple[int, str, str]], on: list[bool], warmup: int) -> dict[str, Any]:
    """Per-step sync counts in on and off steps (after warmup) and those attributed to the hooks (pure)."""
    per_step = collections.Counter(s for s, _, _ in records)
    steps = range(warmup, len(on))
    on_counts = [per_step.get(n, 0) for n in steps if on[n]]
    off_counts = [per_step.get(n, 0) for n in steps if not on[n]]
    owners = collections.Counter(o for _, o, _ in records)
    sites = collections.Counter(f"{o}: {s}" for _, o, s in records)
    return {
        "mode": "warn",
        "syncs_total": len(records),
        "syncs_in_hooks": owners.get("hooks", 0),
        "syncs_by_owner": dict(owners),
        "syncs_per_on_step": statistics.fmean(on_counts) if on_counts else None,
        "syncs_per_off_step": statistics.fmean(off_counts) if off_counts else None,
        "top_sites": [f"{n}x {s}" for s, n in sites.most_common(8)],
    }


# ----------------------------------------------------------------------------- part 1: strict


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sync(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="reference_trainer.bench.gpu_child sync")
    p.add_argument("out")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from reference_trainer.config import PRESETS
    from reference_trainer.data import micro_batches_for
    from reference_trainer.model import GPT, loss_fn
    from reference_trainer.tp_layers import TPGroup
    from trainer_hooks import Tracer

    on_gpu = not a.cpu and torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, **({"device_id": device} if on_gpu else {}))
    preset = PRESETS[a.model]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = GPT(preset, TPGroup(0, 1), 1234).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    grads_of = [p for p in model.parameters() if p.requires_grad]
    data = [tuple(t.to(device) for t in mb) for s in range(2)
            for mb in micro_batches_for(s, 1234, dp_rank=0, dp=1, micro_batch=a.micro_batch, micro_batches=1,
                                        vocab=preset.vocab, seq_len=preset.seq_len)]
    tracer_box: dict[str, Any] = {}
    tee = Tee()

    def step(n: int, tracer: Any) -> None:
        ph = tracer.phase if tracer is not None else (lambda name: _Null())
        ctx = tracer.step(n) if tracer is not None else _Null()
        with ctx:
            with ph("data"):
                x, y = data[n % len(data)]
            with ph("forward"):
                loss = loss_fn(model(x), y)
            with ph("backward"):
                loss.backward()
                for g in grads_of:
                    dist.all_reduce(g.grad)
            with ph("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    result: dict[str, Any] = {"applicable": on_gpu, "backend": f"{backend}, a group of one process",
                              "model": a.model, "dtype": str(dtype).replace("torch.", ""),
                              "steps": a.steps, "collectives_per_step": len(grads_of)}
    for n in range(2):  # warm-up outside the check: NCCL's communicator, cuBLAS, the allocator
        step(n, None)
    if on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(2, None)  # one timed step (one micro-batch): the driver sizes the overhead run by it
    if on_gpu:
        torch.cuda.synchronize()
    result["micro_batch_step_ms"] = (time.perf_counter() - t0) * 1e3
    window: dict[str, int] = {}
    watch: SyncWatch | None = None
    error_sites: list[str] = []
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        try:
            for n in range(a.steps):
                step(n, None)
            result["control_passed"] = True
            result["control_error"] = None
        except RuntimeError as e:
            result["control_passed"] = False
            owner, site = sync_site(traceback.extract_tb(e.__traceback__), threading.current_thread().name)
            result["control_error"] = f"{str(e).splitlines()[0][:200]} at {site} ({owner})"
            # the loop itself synchronizes here: count the hooks' syncs in "warn" mode instead
            torch.cuda.set_sync_debug_mode(0)
            watch = SyncWatch(window)
            watch.start()
        result["mode"] = "error" if watch is None and on_gpu else "warn (the loop itself synchronizes)" if on_gpu else None
        try:
            tracer = tracer_box["t"] = Tracer(run_id="bench-gpu-sync", rank=0, world_size=1,
                                              device="cuda" if on_gpu else "cpu",
                                              drain_interval_s=0.2, heartbeat_s=0.5)
            tee.attach(tracer)
            real_hook_error = tracer.recorder.hook_error

            def hook_error(where: str, e: BaseException) -> None:  # where a hook failed, e.g. on a sync
                if len(error_sites) < 8:
                    site = sync_site(traceback.extract_tb(e.__traceback__), threading.current_thread().name)[1]
                    error_sites.append(f"{where}: {str(e).splitlines()[0][:120]} at {site}")
                real_hook_error(where, e)

            tracer.recorder.hook_error = hook_error
            for n in range(a.steps):
                window["current_step"] = n
                step(n, tracer)
            time.sleep(1.5)  # the emitter resolves, drains and beats under the same mode
            result["hooks_error"] = None
            result["step_rows_under_check"] = len(tee.steps)  # resolved and drained before the mode is lifted
        except RuntimeError as e:
            owner, site = sync_site(traceback.extract_tb(e.__traceback__), threading.current_thread().name)
            result["hooks_error"] = f"{str(e).splitlines()[0][:200]} at {site} ({owner})"
    finally:
        if on_gpu:
            if watch is not None:
                watch.stop()
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    tracer = tracer_box.get("t")
    if tracer is not None:
        tracer.close()
    errors = tracer.errors if tracer is not None else None
    result.update({
        "hook_errors": errors,
        "hook_error_sites": error_sites,
        "step_rows": len(tee.steps),
        "collective_rows": len(tee.collectives),
        "resolved_by_threads": tee.resolved_by(),
    })
    if on_gpu:
        rows_ok = result["hooks_error"] is None and errors == 0 and result.get("step_rows_under_check") == a.steps
        if watch is None:  # strict: under "error" any sync in a hook raised (and was counted)
            result["hooks_passed"] = rows_ok
            result["syncs_added_by_hooks"] = 0 if rows_ok else None
        else:
            figs = sync_figures(watch.records, [True] * a.steps, 0)
            result["warn_mode"] = figs
            result["syncs_added_by_hooks"] = figs["syncs_in_hooks"]
            result["hooks_passed"] = rows_ok and figs["syncs_in_hooks"] == 0
        result["verdict"] = (
            ("pass: no synchronization in the hooks (training thread and emitter) under 'error'" if watch is None else
             "pass (warn mode, attributed): no synchronization in the hooks; the loop itself synchronizes")
            if result["hooks_passed"] else "FAIL: see hooks_error / hook_errors / warn_mode")
    else:
        result["hooks_passed"] = None
        result["syncs_added_by_hooks"] = None
        result["verdict"] = ("not applicable on CPU: torch.cuda.set_sync_debug_mode checks CUDA synchronizations; "
                             "the loop ran with the hooks on and off on gloo, nothing was checked")
    dist.destroy_process_group()
    Path(a.out).write_text(json.dumps(result))
    return 0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


# ----------------------------------------------------------------------------- DDP buckets


def ddp_figures(buckets: list[tuple[int, int, int]], steps: list[dict[str, int]], grad_bytes: int, n_steps: int,
                loop_wall_s: float | None) -> dict[str, Any]:
    """The DDP part's figures from the hooks' rows (pure): ``buckets`` (step, duration_ns, bytes)
    of op all_reduce_ddp, ``steps`` the STEP rows of the traced loop."""
    per_step: dict[int, list[tuple[int, int]]] = {}
    for step, dur, nbytes in buckets:
        per_step.setdefault(step, []).append((dur, nbytes))
    step_dur = {s["step"]: s["duration_ns"] for s in steps}
    counts = sorted({len(v) for v in per_step.values()})
    sums = sorted({sum(b for _, b in v) for v in per_step.values()})
    durs = [d for v in per_step.values() for d, _ in v]
    over_step = [d / step_dur[st] for st, v in per_step.items() for d, _ in v if step_dur.get(st, 0) > 0]
    exposed = [s["comm_exposed_ns"] for s in steps]
    total_step_s = sum(step_dur.values()) / 1e9
    return {
        "grad_bytes": grad_bytes,
        "bucket_rows": len(buckets), "step_rows": len(steps),
        "steps_with_buckets": len(per_step),
        "buckets_per_step": counts[0] if len(counts) == 1 else counts,
        "bucket_bytes_per_step": sums[0] if len(sums) == 1 else sums,
        "bytes_match": sums == [grad_bytes] and len(per_step) == n_steps,
        "bucket_ms_median": statistics.median(durs) / 1e6 if durs else None,
        "bucket_ms_max": max(durs) / 1e6 if durs else None,
        "bucket_over_step_max": max(over_step) if over_step else None,
        "exposed_ms_median": statistics.median(exposed) / 1e6 if exposed else None,
        "steps_device_s": total_step_s,
        "loop_wall_s": loop_wall_s,
        "steps_over_wall": total_step_s / loop_wall_s if loop_wall_s else None,
    }


def _ddp(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="reference_trainer.bench.gpu_child ddp")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainer_hooks import Tracer

    on_gpu = not a.cpu and torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, **({"device_id": device} if on_gpu else {}))
    width, layers, cap_mb = (2048, 8, 25) if on_gpu else (256, 4, 0.25)  # GPU: 134 MB of fp32 gradients
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*mods).to(device), bucket_cap_mb=cap_mb,
                **({"device_ids": [0]} if on_gpu else {}))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
    grad_bytes = sum(q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)
    data = [torch.randn(64, width, device=device, generator=None) for _ in range(2)]

    def step(n: int, tracer: Any) -> None:
        ph = tracer.phase if tracer is not None else (lambda name: _Null())
        with tracer.step(n) if tracer is not None else _Null():
            with ph("forward"):
                loss = model(data[n % 2]).square().mean()
            with ph("backward"):
                loss.backward()
            with ph("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def check(mode: Any) -> None:
        if on_gpu:
            torch.cuda.set_sync_debug_mode(mode)

    result: dict[str, Any] = {"applicable": on_gpu, "backend": f"{backend}, a group of one process",
                              "model": f"{layers} x Linear({width}, {width}), fp32, bucket_cap_mb={cap_mb}",
                              "steps": a.steps, "mode": "error" if on_gpu else None}
    # outside the check: DDP rebuilds its buckets after the first pass, and its logger measures its
    # CUDA timers (synchronizing) in its first 10 iterations (then every 100th: the loop stays below)
    for n in range(12):
        step(n, None)
    sync()
    tee = Tee()
    tracer = None
    error_sites: list[str] = []
    try:
        check("error")
        try:
            for n in range(a.steps):
                step(n, None)
            result.update(control_passed=True, control_error=None)
        except RuntimeError as e:  # the plain DDP loop synchronizes: the check below cannot be strict
            owner, site = sync_site(traceback.extract_tb(e.__traceback__), threading.current_thread().name)
            result.update(control_passed=False, control_error=f"{str(e).splitlines()[0][:200]} at {site} ({owner})")
        check(0)
        sync()
        if result["control_passed"] or not on_gpu:
            check("error")
        else:
            result["mode"] = "off (the plain DDP loop synchronizes: see control_error)"
        t0 = 0.0
        try:
            tracer = Tracer(run_id="bench-gpu-ddp", rank=0, world_size=1, drain_interval_s=0.2, heartbeat_s=0.5,
                            **({"device": "cuda"} if on_gpu else {"device_clock": HostClock()}))
            tee.attach(tracer)
            real_hook_error = tracer.recorder.hook_error

            def hook_error(where: str, e: BaseException) -> None:
                if len(error_sites) < 8:
                    site = sync_site(traceback.extract_tb(e.__traceback__), threading.current_thread().name)[1]
                    error_sites.append(f"{where}: {str(e).splitlines()[0][:120]} at {site}")
                real_hook_error(where, e)

            tracer.recorder.hook_error = hook_error
            t0 = time.perf_counter()  # the device is idle (synchronized above): the loop's wall clock starts
            for n in range(a.steps):
                step(n, tracer)
            result["hooks_error"] = None
        except RuntimeError as e:
            owner, site = sync_site(traceback.extract_tb(e.__traceback__), threading.current_thread().name)
            result["hooks_error"] = f"{str(e).splitlines()[0][:200]} at {site} ({owner})"
        check(0)
        sync()  # the loop's device work is done: the host wall clock of the loop ends here
        result["loop_wall_s"] = time.perf_counter() - t0 if t0 else None
        if result["mode"] == "error":
            check("error")
        time.sleep(1.5)  # the emitter resolves, drains and beats, under the check again
        result["step_rows_under_check"] = len(tee.steps)
    finally:
        check(0)
        sync()
    if tracer is not None:
        tracer.close()
    buckets = [c for c in tee.collectives if c[3] == "all_reduce_ddp"]
    figures = ddp_figures([c[:3] for c in buckets], [s for s in tee.steps if s["step"] >= 0], grad_bytes, a.steps,
                          result.pop("loop_wall_s"))
    result.update(figures)
    resolved = tee.resolved_by()
    result.update({
        "hook_errors": tracer.errors if tracer is not None else None,
        "hook_error_sites": error_sites,
        "timed_by_comm_hook": bool(getattr(model._comm_hooks[0][0], "_tracetop_timed", False)) if model._comm_hooks else False,
        "resolved_by_threads": resolved,
        "emitter_resolves": bool(resolved) and set(resolved) == {"tracetop-emitter"},
    })
    ok = (result["hooks_error"] is None and result["hook_errors"] == 0 and result["bytes_match"]
          and result["emitter_resolves"] and result["step_rows_under_check"] == a.steps)
    if on_gpu:
        result["hooks_passed"] = ok and result["mode"] == "error"
        result["syncs_added_by_hooks"] = 0 if result["hooks_passed"] else None
        result["verdict"] = ("pass: every bucket timed on CUDA events, its bytes the gradients', resolved by the emitter, "
                             "no synchronization under 'error'" if result["hooks_passed"] else
                             "FAIL: see hooks_error / hook_errors / bytes_match / emitter_resolves / mode")
    else:
        result["hooks_passed"] = None
        result["syncs_added_by_hooks"] = None
        result["verdict"] = ("rehearsal: the CUDA-event code path over host events ("
                             + ("rows, bytes and resolution as on a GPU" if ok else "FAILED: see the figures")
                             + "); set_sync_debug_mode checks CUDA only: not applicable on CPU")
        result["rehearsal_ok"] = ok
    dist.destroy_process_group()
    Path(a.out).write_text(json.dumps(result))
    return 0 if (ok or on_gpu) else 1


# ----------------------------------------------------------------------------- parts 2 and 3


def timing_figures(steps: list[dict[str, int]], wall_s: list[float], on: list[bool], warmup: int,
                   collectives: list[tuple[int, int, int]], tolerance_pct: float) -> dict[str, Any]:
    """Part 3 (pure): per measured step, (data wait + forward + backward + optimizer + exposed
    communication) / the step's duration, both from the hooks' timer; and that duration / the
    trainer's own host wall time of the step (perf_counter around train_batch, which ends in a
    device sync). Medians, ranges and whether both sit within tolerance_pct of 1."""
    by_step = {s["step"]: s for s in steps}
    sums, ratios = [], []
    for n in range(warmup, min(len(on), len(wall_s))):
        s = by_step.get(n)
        if not on[n] or s is None or s["duration_ns"] <= 0:
            continue
        parts = s["data_wait_ns"] + s["forward_ns"] + s["backward_ns"] + s["optimizer_ns"] + s["comm_exposed_ns"]
        sums.append(parts / s["duration_ns"])
        ratios.append(s["duration_ns"] / 1e9 / wall_s[n])
    coll_per_step = collections.Counter(c[0] for c in collectives if c[0] >= warmup)
    tol = tolerance_pct / 100 + 1e-9  # a ratio exactly at the tolerance is within it
    out: dict[str, Any] = {
        "steps_compared": len(sums),
        "tolerance_pct": tolerance_pct,
        "phase_sum_over_step_median": statistics.median(sums) if sums else None,
        "phase_sum_over_step_min": min(sums) if sums else None,
        "phase_sum_over_step_max": max(sums) if sums else None,
        "step_over_wall_median": statistics.median(ratios) if ratios else None,
        "step_over_wall_min": min(ratios) if ratios else None,
        "step_over_wall_max": max(ratios) if ratios else None,
        "collectives_per_step": statistics.median(coll_per_step.values()) if coll_per_step else 0,
    }
    out["within_tolerance"] = bool(sums) and abs(out["phase_sum_over_step_median"] - 1) <= tol and \
        abs(out["step_over_wall_median"] - 1) <= tol
    return out


def _event_microbench(device: str, blocks: int, steps_per_block: int = 20) -> dict[str, float]:
    """Training-thread CPU per recorded event, on the given timer path: per step a step context,
    4 phases and 10 stand-in collectives through the collective wrapper (the collective itself
    does nothing: its cost is the same with and without hooks). Blocks with hooks on and off
    alternate; (on - off) thread CPU / events, median over blocks."""
    import torch

    from trainer_hooks.integrations import collectives as colls
    from trainer_hooks.tracer import Tracer

    tensor = torch.ones(256, device=device)
    tracer = Tracer(run_id="bench-gpu-micro", rank=0, world_size=1, wrap_collectives=False, device=device,
                    heartbeat_s=5.0)

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    wrapped = colls.wrap_function("all_reduce", all_reduce)
    tracer.set_topology({"dp": [(0,)]})

    class _N:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *e: Any) -> bool:
            return False

    null = _N()

    def block(on: bool) -> tuple[int, int]:
        ar = wrapped if on else all_reduce
        colls.route_to(tracer.recorder if on else None)
        c0 = time.thread_time_ns()
        for n in range(steps_per_block):
            with tracer.step(n) if on else null:
                for name in ("data", "forward", "backward", "optimizer"):
                    with tracer.phase(name) if on else null:
                        ar(tensor)
                        ar(tensor)
                ar(tensor)
                ar(tensor)
        return time.thread_time_ns() - c0, 15 * steps_per_block if on else 0

    per_event = []
    try:
        block(True)
        block(False)
        for _ in range(blocks):
            on_cpu, events = block(True)  # per step: the step, 4 phases, 10 collectives = 15 events
            off_cpu, _ = block(False)
            per_event.append((on_cpu - off_cpu) / max(1, events))
    finally:
        colls.route_to(None)
        tracer.close()
    return {"ns_per_event": statistics.median(per_event),
            "ns_per_event_p90": sorted(per_event)[int(0.9 * (len(per_event) - 1))]}


def _hooks(argv: list[str]) -> int:
    out, block, warmup, seed, trainer_argv = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4:]
    cpu = "--cpu" in trainer_argv
    trainer_argv = [x for x in trainer_argv if x != "--cpu"]
    micro_blocks = 40
    if "--micro-blocks" in trainer_argv:
        i = trainer_argv.index("--micro-blocks")
        micro_blocks = int(trainer_argv[i + 1])
        del trainer_argv[i:i + 2]
    tolerance_pct = 5.0 if not cpu else 20.0
    tee, step_times, window = Tee(host_clock=cpu), {}, {}
    _patch_trainer(tee, step_times, window)
    watch = None
    import torch

    if not cpu and torch.cuda.is_available():
        watch = SyncWatch(window)
        watch.start()
    from reference_trainer.bench import hooks_child as _bench_child

    rc = _bench_child.main([str(out), str(block), str(warmup), str(seed), *trainer_argv])
    if watch is not None:
        watch.stop()
    if rc:
        return rc
    log = json.loads(out.read_text())
    extra: dict[str, Any] = {}
    extra["timing"] = timing_figures(tee.steps, log["wall_s"], log["on"], warmup, tee.collectives, tolerance_pct)
    resolved = tee.resolved_by()
    main_name = threading.main_thread().name
    extra["timing"].update({
        "timer": ("perf_counter through the deferred (CUDA-event) path, resolved by the emitter: CPU rehearsal" if cpu
                  else "cuda events" if tee.clocks else "perf_counter"),
        "resolved_by_threads": resolved,
        "resolved_on_training_thread": resolved.get(main_name, 0) if tee.clocks else None,
        "emitter_resolves": (bool(resolved) and set(resolved) == {"tracetop-emitter"}) if tee.clocks else None,
    })
    extra["syncs"] = (sync_figures(watch.records, log["on"], warmup) if watch is not None else
                      {"mode": None, "note": "not applicable on CPU: set_sync_debug_mode watches CUDA only"})
    import argparse

    from reference_trainer.bench import hooks as hooks_bench

    endpoint = os.environ.get("TRACETOP_ENDPOINT", "127.0.0.1:1")
    cpu_path = hooks_bench.microbench(argparse.Namespace(micro_blocks=micro_blocks), endpoint)
    extra["events"] = {"ns_per_event_cpu_path": cpu_path["ns_per_event"],
                       "ns_per_event_cpu_path_p90": cpu_path["ns_per_event_p90"]}
    if tee.clocks and not cpu:
        cuda_path = _event_microbench("cuda", micro_blocks)
        extra["events"].update({"ns_per_event_cuda_path": cuda_path["ns_per_event"],
                                "ns_per_event_cuda_path_p90": cuda_path["ns_per_event_p90"]})
    else:
        extra["events"]["ns_per_event_cuda_path"] = None
    out.with_suffix(".extra.json").write_text(json.dumps(extra))
    return 0


# ----------------------------------------------------------------------------- part 5


def _offload(argv: list[str]) -> int:
    out, warmup, trainer_argv = Path(argv[0]), int(argv[1]), argv[2:]
    tee, step_times, window = Tee(), {}, {}
    _patch_trainer(tee, step_times, window)
    from reference_trainer import train

    rc = train.main(trainer_argv)
    if rc:
        return rc
    last = max(step_times) if step_times else -1
    t0, t1 = step_times.get(warmup), window.get("closed_ns")
    rows = [r for r in tee.offloads if warmup <= r[0] <= last]
    by: dict[str, dict[str, int]] = {}
    for _, direction, _what, nbytes, dur in rows:
        d = by.setdefault(direction, {"bytes": 0, "copy_ns": 0, "rows": 0})
        d["bytes"] += nbytes
        d["copy_ns"] += dur
        d["rows"] += 1
    Path(out).write_text(json.dumps({
        "window_start_ns": t0, "window_end_ns": t1, "steps": last - warmup + 1, "by_direction": by,
        "rows_total": len(tee.offloads), "whats": sorted({r[2] for r in rows}),
    }))
    return 0


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    if mode == "sync":
        return _sync(rest)
    if mode == "hooks":
        return _hooks(rest)
    if mode == "offload":
        return _offload(rest)
    if mode == "ddp":
        return _ddp(rest)
    print(f"reference_trainer.bench.gpu_child: unknown mode {mode!r}; use sync, hooks, ddp or offload", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
