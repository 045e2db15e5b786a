"""`tracetop bench agent [--json]`: what the agent costs, in percent of one CPU core.

One run, real processes: a collector (`tracetop collector`, a subprocess), an agent
(`tracetop agent --fake-gpus 8 --interval-s 1`), and for the relay windows a client process that
ships STEP rows at --events-per-s through the agent's socket with the shared shipper. The agent's
CPU time (user + system, all threads, from psutil) is read at the edges of each window; windows
alternate (sampling only, relaying, sampling only, relaying, ...) so both see the same machine.

- sampling_cpu_pct: the agent's whole CPU while it only samples (8 fake GPUs + host at 1 Hz,
  shipping its own rows; its idle gRPC server, clock probe and metrics endpoint included),
  pooled over the sampling windows.
- relay_cpu_pct: the agent's extra CPU while relaying (relay windows minus sampling windows,
  each pooled); agent_cpu_pct_relaying is the relay windows' total.
- sample_ms_per_interval: in-process CPU time of one sampling pass (8 fake GPUs + host, columns
  built), for reference. The fake backend costs less per call than a real driver's ioctl does.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--window-s", type=float, default=8.0, help="seconds per measurement window (default 8)")
    p.add_argument("--rounds", type=int, default=2, help="sampling+relay window pairs (default 2)")
    p.add_argument("--events-per-s", type=int, default=10_000, help="relay load (default 10000)")
    p.add_argument("--gpus", type=int, default=8, help="fake GPUs the agent samples (default 8)")
    p.add_argument("--interval-s", type=float, default=1.0, help="agent sampling interval (default 1)")


def client(endpoint: str, events_per_s: int, duration_s: float) -> None:
    """The relay load: STEP rows at a steady rate, in 20 ms chunks through record_many."""
    import time

    import numpy as np

    from tracetop.events import SCHEMAS, Kind
    from tracetop.wire.shipper import Shipper

    s = Shipper(endpoint, run_id="bench-agent", source_id=f"bench-client-{time.time_ns()}")
    chunk_s = 0.02
    per_chunk = max(1, int(events_per_s * chunk_s))
    names = [c.name for c in SCHEMAS[Kind.STEP]]
    t0 = time.monotonic()
    sent = 0
    step = 0
    while time.monotonic() - t0 < duration_s:
        cols = {n: np.zeros(per_chunk, "<i8") for n in names}
        cols["rank"] = np.zeros(per_chunk, "<i4")
        cols["step"] = np.arange(step, step + per_chunk, dtype="<i8")
        cols["start_ns"] = np.full(per_chunk, time.time_ns(), "<i8")
        s.record_many(Kind.STEP, cols)
        step += per_chunk
        sent += per_chunk
        delay = t0 + sent / events_per_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    s.flush(30)
    s.close(1)


def _in_process_sample_ms(gpus: int, passes: int = 50) -> float:
    import time

    from agent.fake_nvml import FakeNVML
    from agent.gpu import GPUSampler
    from agent.host import HostSampler
    from agent.nvml import NVML

    nvml = NVML(FakeNVML(gpus))
    nvml.start()
    g = GPUSampler(nvml, "bench")
    h = HostSampler("bench")
    g.sample()
    h.sample()
    t = time.thread_time()
    for _ in range(passes):
        g.sample()
        h.sample()
    return (time.thread_time() - t) / passes * 1e3


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import re
    import statistics
    import subprocess
    import sys
    import tempfile
    import time
    import urllib.request
    from pathlib import Path

    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="tracetop-bench-agent-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []

    from tracetop import procs as services

    def start(service: services.ServiceProcess) -> services.ServiceProcess:
        service.env = dict(env, PYTHONUNBUFFERED="1")
        service.start(120)
        procs.append(service.proc)  # type: ignore[arg-type]
        return service

    def log(msg: str) -> None:
        if not args.json:
            print(msg, flush=True)

    try:
        collector_addr = f"unix://{tmp / 'collector.sock'}"
        start(services.collector(tmp / "bench.duckdb", collector_addr))
        sock = f"unix://{tmp / 'agent.sock'}"
        agent_service = start(services.agent(
            collector_addr, sock, spool_dir=tmp / "spool",
            extra_args=["--fake-gpus", str(args.gpus), "--interval-s", str(args.interval_s), "--metrics-port", "0"],
        ))
        agent = agent_service.proc
        assert agent is not None
        metrics_url = f"http://127.0.0.1:{agent_service.metrics_port}/metrics"
        aproc = psutil.Process(agent.pid)

        def relayed_rows() -> float:
            body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
            hit = re.search(r"^tracetop_agent_relay_rows_total\{[^}]*\} (\S+)$", body, re.M)
            return float(hit.group(1)) if hit else 0.0

        def window() -> tuple[float, float]:
            """(agent CPU seconds, wall seconds) over one window."""
            c0 = aproc.cpu_times()
            t0 = time.monotonic()
            time.sleep(args.window_s)
            c1 = aproc.cpu_times()
            return (c1.user - c0.user) + (c1.system - c0.system), time.monotonic() - t0

        time.sleep(2.0)  # let start-up work (imports, first clock probe) settle
        sampling: list[tuple[float, float]] = []
        relaying: list[tuple[float, float]] = []
        rates: list[float] = []

        def pct(w: tuple[float, float]) -> float:
            return w[0] / w[1] * 100.0

        for r in range(args.rounds):
            sampling.append(window())
            log(f"round {r}: sampling only {pct(sampling[-1]):.2f}% of a core")
            client = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from agent.bench.cost import client; client({sock!r}, {args.events_per_s}, "
                    f"{args.window_s + 3.0})",
                ],
                env=env,
            )
            procs.append(client)
            time.sleep(1.5)  # client start-up and connection, outside the window
            rows0, t0 = relayed_rows(), time.monotonic()
            relaying.append(window())
            rates.append((relayed_rows() - rows0) / (time.monotonic() - t0))
            log(f"round {r}: relaying {rates[-1]:.0f} events/s: {pct(relaying[-1]):.2f}% of a core")
            client.wait(120)
            time.sleep(1.0)  # the agent forwards the client's last batches before the next sampling window
        # Pooled over the windows (CPU time is counted in 10 ms ticks: pooling beats a median).
        sampling_pct = sum(c for c, _ in sampling) / sum(w for _, w in sampling) * 100.0
        relay_total = sum(c for c, _ in relaying) / sum(w for _, w in relaying) * 100.0
        result = {
            "sampling_cpu_pct": round(sampling_pct, 3),
            "relay_cpu_pct": round(max(0.0, relay_total - sampling_pct), 3),
            "agent_cpu_pct_relaying": round(relay_total, 3),
            "relay_events_per_s": round(statistics.median(rates), 1),
            "sample_ms_per_interval": round(_in_process_sample_ms(args.gpus), 3),
            "gpus": args.gpus,
            "interval_s": args.interval_s,
            "window_s": args.window_s,
            "rounds": args.rounds,
            "sampling_cpu_pct_windows": [round(pct(w), 3) for w in sampling],
            "relay_cpu_pct_windows": [round(pct(w), 3) for w in relaying],
            "gpu_backend": "fake",
        }
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"agent sampling ({args.gpus} fake GPUs + host at {1 / args.interval_s:g} Hz): "
            f"{result['sampling_cpu_pct']:.2f}% of a core; relaying {result['relay_events_per_s']:.0f} events/s: "
            f"+{result['relay_cpu_pct']:.2f}% (agent total {result['agent_cpu_pct_relaying']:.2f}%); "
            f"one sampling pass {result['sample_ms_per_interval']:.2f} ms"
        )
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0
