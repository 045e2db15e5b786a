"""``tracetop bench commands``: what the command path's broadcast costs, on its own.

N processes (default 4) on gloo over loopback, each with a real ``CommandBus`` (no subscriber):
every iteration is one boundary (``receive``: the 64-byte broadcast from rank 0 carrying
"nothing"), timed on each rank with ``perf_counter_ns``. One boundary happens every K steps, so
the figure is the cost per K steps (``us_per_boundary``). Then the same with a command in every
broadcast (``us_per_command``: the broadcast, the handler, the 8-byte MIN all-reduce), which
happens once per command. The ranks loop back to back here, so this is the collective's own
latency; in training a boundary also waits for the slowest rank to finish its step, a wait the
training's own next collective would have had anyway.

``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--iterations", type=int, default=2000, help="boundaries timed per rank (default 2000)")
    parser.add_argument("--json", action="store_true")


class _Rank:
    """What a CommandBus reads of its Tracer."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.micro_batch, self.micro_batches = 4, 4
        self.run_id, self.endpoint = "bench-commands", None
        self.warned: set[str] = set()
        self.errors = 0
        self.recorder = self  # the bus counts its errors on the Tracer's recorder

    def hook_error(self, where: str, e: BaseException) -> None:
        self.errors += 1
        print(f"bench commands: rank {self.rank}: {where}: {e!r}", file=sys.stderr)


class _Cmd:
    def __init__(self, i: int) -> None:
        self.command_id, self.kind, self.int_value, self.rollback_of, self.expires_ns = str(i), 1, 2 + i % 2, "", 0


def _child(rank: int, world: int, port: int, iterations: int, out: str) -> None:
    import torch.distributed as dist

    from trainer_hooks.commands import CommandBus

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = _Rank(rank, world)
    bus = CommandBus(t, every_steps=1, subscribe=False, drop="")
    bus._report_raw = lambda *a, **k: None  # type: ignore[method-assign]  # nothing to report to here
    empty, full = [], []
    for i in range(200 + iterations):  # "nothing" most of the time
        t0 = time.perf_counter_ns()
        bus.receive(i)
        if i >= 200:
            empty.append(time.perf_counter_ns() - t0)
    for i in range(50 + iterations // 4):  # a command every time
        if rank == 0:
            bus.inbox.append(_Cmd(i))
        t0 = time.perf_counter_ns()
        p = bus.receive(i)
        if p is not None:
            bus.settle(p, True)
        if i >= 50:
            full.append(time.perf_counter_ns() - t0)
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"empty": empty, "full": full, "errors": t.errors}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_child, args=(args.nproc, port, args.iterations, out), nprocs=args.nproc, join=True,
                           start_method="spawn")
        per = [json.load(open(os.path.join(out, f"r{r}.json"))) for r in range(args.nproc)]
    med = [statistics.median(p["empty"]) / 1e3 for p in per]
    p99 = [sorted(p["empty"])[int(0.99 * len(p["empty"]))] / 1e3 for p in per]
    full = [statistics.median(p["full"]) / 1e3 for p in per]
    result = {"nproc": args.nproc, "iterations": args.iterations, "us_per_boundary": round(statistics.median(med), 1),
              "us_per_boundary_max_rank": round(max(med), 1), "us_per_boundary_p99": round(max(p99), 1),
              "us_per_command": round(statistics.median(full), 1), "errors": sum(p["errors"] for p in per),
              "load_avg_1m": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"broadcast per boundary (every K steps): {result['us_per_boundary']} us median over ranks "
              f"(slowest rank {result['us_per_boundary_max_rank']} us, p99 {result['us_per_boundary_p99']} us); "
              f"a boundary with a command: {result['us_per_command']} us; {args.nproc} processes, load {result['load_avg_1m']:.1f}")
    return 0
