"""The agent-side parts of ``tracetop bench gpu`` (``reference_trainer/bench/gpu.py``), one process each.

``python -m agent.bench.gpu MODE OUT.json ...``, MODE one of:

* ``agent OUT --duration-s S --collector ADDR [--fake]``: part 4. The real ``Agent`` (NVML through
  ``agent.nvml.NVML``, host sampling, relay, clock probe, XID watcher) for S seconds at 1 Hz,
  shipping to ADDR. Figures: which GPU_SAMPLE fields came back and which were null, the NVML
  calls that answered null (``NVML.unsupported``), the wall and CPU time of each sampling pass
  (every GPU and the host, columns built), whether the XID watcher's thread is up and on which GPUs.
  ``--fake``: the fake NVML of ``agent/fake_nvml.py`` (CPU mode).
* ``pcie OUT [--interval-s 0.05] [--fake]``: part 5's NVML side. Samples GPU 0's PCIe traffic
  until its stdin closes: the cumulative counters (``NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES``) and
  ``nvmlDeviceGetPcieThroughput`` (KB/s over NVML's own ~20 ms window), each sample stamped
  with ``time.time_ns()`` (the trainer process stamps its window with the same clock). Prints
  ``ready`` once the first sample is in. OUT gets the samples.

Layering: agent modules only (no torch, no trainer_hooks, no collector; DESIGN §2).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _backend(fake: bool) -> Any:
    if not fake:
        return None  # pynvml, the real driver
    from agent.fake_nvml import FakeNVML

    return FakeNVML(1)


def _agent(argv: list[str]) -> int:
    import argparse

    from agent.daemon import Agent, AgentConfig
    from agent.gpu import GpuReading

    p = argparse.ArgumentParser(prog="agent.bench.gpu agent")
    p.add_argument("out")
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--collector", default="127.0.0.1:1")
    p.add_argument("--fake", action="store_true")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tracetop-bench-gpu-agent-"))
    cfg = AgentConfig(collector=a.collector, listen=[f"unix://{tmp}/agent.sock"], interval_s=1.0,
                      spool_dir=str(tmp / "spool"), clock_interval_s=10.0)
    agent = Agent(cfg, nvml_backend=_backend(a.fake), out=sys.stdout)
    passes_wall: list[float] = []
    passes_cpu: list[float] = []
    real_sample = agent.sample_once

    def timed_sample() -> None:
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        real_sample()
        passes_wall.append((time.perf_counter_ns() - t0) / 1e6)
        passes_cpu.append((time.thread_time_ns() - c0) / 1e6)

    agent.sample_once = timed_sample  # type: ignore[method-assign]
    agent.start()
    stop = threading.Event()
    runner = threading.Thread(target=agent.run, args=(stop,), name="bench-agent-run", daemon=True)
    cpu0, wall0 = time.process_time(), time.monotonic()
    runner.start()
    time.sleep(a.duration_s)
    stop.set()
    runner.join(10)
    cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
    result: dict[str, Any] = {"backend": "fake" if a.fake else "nvml", "duration_s": round(wall_s, 2),
                              "passes": len(passes_wall), "nvml_notice": agent.nvml_notice}
    if agent.nvml is not None and agent.gpu is not None:
        q = agent.nvml.query
        drv = q("nvmlSystemGetDriverVersion")
        names = [q("nvmlDeviceGetName", h) for h in agent.nvml.handles]
        readings, procs = agent.gpu.read()
        fields = GpuReading._fields[2:]
        read = sorted({f for r in readings for f in fields if getattr(r, f) is not None})
        result.update({
            "driver_version": drv.decode() if isinstance(drv, bytes) else drv,
            "gpus": [n.decode() if isinstance(n, bytes) else n for n in names],
            "fields_read": read,
            "fields_null": sorted(set(fields) - set(read)),
            "last_reading": {f: getattr(readings[0], f) for f in fields} if readings else {},
            "processes_seen": len(procs),
            "unsupported_calls": [f"{name} (GPU {dev})" for name, dev in agent.nvml.unsupported()],
        })
    xid = agent.xid
    result.update({
        "xid_watcher_up": bool(xid is not None and xid._thread is not None and xid._thread.is_alive()),
        "xid_registered_gpus": list(xid.registered) if xid is not None else [],
        "xid_events": agent.stats().get("xid_events", 0),
        "sample_ms_per_pass": statistics.median(passes_wall) if passes_wall else None,
        "sample_ms_per_pass_max": max(passes_wall) if passes_wall else None,
        "sample_cpu_ms_per_pass": statistics.median(passes_cpu) if passes_cpu else None,
        "agent_cpu_pct": round(100 * cpu_s / wall_s, 3) if wall_s > 0 else None,
        "collector_connected": bool(agent.stats().get("collector_connected")),
    })
    agent.stop(flush_timeout_s=2.0)
    Path(a.out).write_text(json.dumps(result, default=str))
    return 0


def _pcie(argv: list[str]) -> int:
    import argparse

    from agent.nvml import NVML

    p = argparse.ArgumentParser(prog="agent.bench.gpu pcie")
    p.add_argument("out")
    p.add_argument("--interval-s", type=float, default=0.05)
    p.add_argument("--max-s", type=float, default=600.0)
    p.add_argument("--fake", action="store_true")
    a = p.parse_args(argv)
    nvml = NVML(_backend(a.fake))
    nvml.start()
    b = nvml.backend
    h = nvml.handles[0]
    fields = [b.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, b.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
    tx_c, rx_c = getattr(b, "NVML_PCIE_UTIL_TX_BYTES", 0), getattr(b, "NVML_PCIE_UTIL_RX_BYTES", 1)
    done = threading.Event()

    def wait_stdin() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    samples: list[tuple[int, Any, Any, Any, Any]] = []  # (time_ns, tx_bytes, rx_bytes, tx_kBps, rx_kBps)
    t_end = time.monotonic() + a.max_s
    while True:
        t = time.time_ns()
        tx, rx = nvml.field_values(h, fields)
        thr_tx = nvml.query("nvmlDeviceGetPcieThroughput", h, tx_c)
        thr_rx = nvml.query("nvmlDeviceGetPcieThroughput", h, rx_c)
        samples.append((t, tx, rx, thr_tx, thr_rx))
        if len(samples) == 1:
            print("ready", flush=True)
        if done.wait(a.interval_s) or time.monotonic() > t_end:
            break
    nvml.stop()
    Path(a.out).write_text(json.dumps({"backend": "fake" if a.fake else "nvml", "samples": samples,
                                       "unsupported_calls": [f"{n} (GPU {d})" for n, d in nvml.unsupported()]}))
    return 0


def main(argv: list[str]) -> int:
    mode, rest = (argv[0], argv[1:]) if argv else ("", [])
    if mode == "agent":
        return _agent(rest)
    if mode == "pcie":
        return _pcie(rest)
    print(f"agent.bench.gpu: unknown mode {mode!r}; use agent or pcie", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
