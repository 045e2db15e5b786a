"""A plain DDP training loop (gloo, under torchrun), written the way a user writes one, with the
hooks as trainer_hooks/README.md shows them (``Tracer`` as a context manager, ``step``, ``phase``,
``set_loss``), and faults with real effects: `tracetop bench judge` runs it, and the live judging
tests do (tests/collector/live/failure_loop.py).

    torchrun --standalone --nproc_per_node 4 -m collector.bench.judge_loop --steps 40 --fault forward:2:1.0@15

--fault KIND:RANK:X@STEP   from STEP, on RANK (X sized by the rank's own median step wall time over
                           the steps before STEP, ``base``: faults proportional to the step time):
    forward    sleeps X x base inside its forward, every step
    backward   sleeps X x base inside its backward, after the last layer's gradients are ready and
               DDP's first bucket is in flight (a hook on an earlier activation's gradient)
    creep      sleeps X x base x (steps since STEP + 1) inside its forward: a creeping slowdown
    data       sleeps X x base inside its data phase (a slow data loader)
    comm       sleeps X x base in DDP's comm hook before its first bucket's all-reduce (enters the
               gradient reduction late: slow communication on one rank)
    mem        allocates and touches X MB more every step (held)
    stall      sleeps X seconds inside its forward, once at STEP (its peers wait in DDP's all-reduce)
    hang       enters an all-reduce on a group no other rank joins, at STEP (blocks to the timeout)
    loss       (every rank) the batch of STEP is scaled by X: a real loss spike
--kill R@S      rank R sends itself SIGKILL in its forward of step S (no clean close)
--late R:SEC    rank R sleeps SEC seconds after the DDP model is built, before its Tracer starts
--die-early R   rank R exits (os._exit(1)) 3 s after the DDP model is built, before its Tracer starts
--slow-data R:MS@S  rank R's data loading takes MS ms longer (inside its data phase) from step S
--step-ms MS    each step computes about MS ms (sleep inside forward), default 30
--timeout-s S   the process group's timeout (a survivor blocked in a collective with the dead rank
                errors out after S s and closes its hooks; below torchrun's 30 s SIGTERM grace)
--pid-dir DIR   each rank writes rank<R>.pid and, every step, rank<R>.step (what the bench's noise
                and SIGSTOP faults act on from outside)

Each fault prints ``[judge_loop] onset rank R step S unix_ns T`` when it starts acting.
Every rank ends through its own SIGTERM handler (SystemExit: the ``with`` block closes the hooks),
as a preemption-aware trainer does, or through the error its collective with the dead rank raises.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import statistics
import sys
import time

KINDS = ("forward", "backward", "creep", "data", "comm", "mem", "stall", "hang", "loss")
WARMUP = 3  # steps left out of the base step time (first DDP steps, imports)


def parse_fault(text: str) -> tuple[str, int, float, int]:
    try:
        kind, rank, rest = text.split(":", 2)
        x, step = rest.split("@")
        if kind not in KINDS:
            raise ValueError
        return kind, int(rank), float(x), int(step)
    except ValueError:
        raise SystemExit(f"--fault {text!r}: expected KIND:RANK:X@STEP with KIND one of {', '.join(KINDS)}, "
                         f"e.g. forward:2:1.0@15") from None


def _onset(rank: int, step: int, what: str) -> None:
    print(f"[judge_loop] onset rank {rank} step {step} unix_ns {time.time_ns()} {what}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill", default="")
    ap.add_argument("--late", default="")
    ap.add_argument("--die-early", type=int, default=-1)
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--timeout-s", type=float, default=0.0)
    ap.add_argument("--slow-data", default="")
    ap.add_argument("--fault", action="append", default=[])
    ap.add_argument("--pid-dir", default="")
    a = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    import trainer_hooks

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.timeout_s:
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    faults = [parse_fault(f) for f in a.fault]
    mine = [f for f in faults if f[1] == rank or f[0] == "loss"]
    hang_group = dist.new_group(list(range(world))) if any(f[0] == "hang" for f in faults) else None
    if a.pid_dir:
        with open(os.path.join(a.pid_dir, f"rank{rank}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 64))
    # small buckets: the last layers' gradients go out while the earlier ones are still computed
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)
    if a.die_early == rank:
        time.sleep(3.0)  # the others are past the DDP constructor's collectives and start their hooks
        _onset(rank, -1, "die-early")
        os._exit(1)
    if a.late:
        r, sec = a.late.split(":")
        if int(r) == rank:
            _onset(rank, -1, "late")
            time.sleep(float(sec))
    kill_rank, kill_step = (int(x) for x in a.kill.split("@")) if a.kill else (-1, -1)
    data_rank, data_ms, data_from = -1, 0.0, 0
    if a.slow_data:
        r, rest = a.slow_data.split(":")
        ms, s = rest.split("@")
        data_rank, data_ms, data_from = int(r), float(ms), int(s)
    walls: list[float] = []
    state = {"step": -1, "comm_s": 0.0, "back_s": 0.0, "comm_sent": False}

    def base_s(before: int) -> float:
        w = walls[WARMUP:before] or walls[:before] or [a.step_ms / 1e3]
        return statistics.median(w)

    def extra_s(kind: str, step: int) -> float:
        out = 0.0
        for k, _, x, s in mine:
            if k == kind and step >= s:
                out += x * base_s(s) * ((step - s + 1) if kind == "creep" else 1)
        return out

    if any(f[0] == "comm" for f in mine):
        def late_allreduce(_state, bucket):
            if not state["comm_sent"]:
                state["comm_sent"] = True
                if state["comm_s"] > 0:
                    time.sleep(state["comm_s"])
            fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(None, late_allreduce)
    if any(f[0] == "backward" for f in mine):
        def slow_backward(_m, _inp, out):
            # its gradient is computed in backward once the last layer's are (their bucket is out)
            if out.requires_grad and state["back_s"] > 0:
                out.register_hook(lambda g: (time.sleep(state["back_s"]), g)[1])

        net[2].register_forward_hook(slow_backward)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    held = []
    started: set[tuple] = set()

    def onset(f: tuple, step: int) -> None:
        if f not in started:
            started.add(f)
            _onset(f[1], step, f[0])

    with trainer_hooks.Tracer() as tracer:
        for step in range(a.steps):
            t0 = time.perf_counter()
            state["step"], state["comm_sent"] = step, False
            if a.pid_dir:
                with open(os.path.join(a.pid_dir, f"rank{rank}.step"), "w") as fh:
                    fh.write(str(step))
            active = [f for f in mine if step >= f[3]]
            for f in active:
                onset(f, step)
            with tracer.step(step):
                with tracer.phase("data"):
                    if rank == data_rank and step >= data_from:
                        time.sleep(data_ms / 1e3)
                    time.sleep(extra_s("data", step))
                    x = torch.randn(64, 64, generator=gen)
                    if any(k == "loss" and step == s for k, _, _, s in mine):
                        x = x * next(v for k, _, v, s in mine if k == "loss" and step == s)
                for k, _, mb, s in mine:
                    if k == "mem" and step >= s:
                        held.append(torch.ones(int(mb * 2**20) // 4))
                with tracer.phase("forward"):
                    if rank == kill_rank and step == kill_step:
                        print(f"[failure_loop] rank {rank}: SIGKILL at step {step}", flush=True)
                        _onset(rank, step, "kill")
                        os.kill(os.getpid(), signal.SIGKILL)
                    for k, _, sec, s in mine:
                        if k == "stall" and step == s:
                            time.sleep(sec)
                        if k == "hang" and step == s:
                            print(f"[judge_loop] rank {rank}: hang at step {step}: an all-reduce no other rank joins",
                                  flush=True)
                            dist.all_reduce(torch.zeros(1), group=hang_group)  # blocks to the timeout
                    time.sleep(a.step_ms / 1e3 + extra_s("forward", step) + extra_s("creep", step))
                    state["back_s"] = extra_s("backward", step)
                    state["comm_s"] = extra_s("comm", step)
                    out = model(x)
                    loss = out.pow(2).mean()
                    tracer.set_loss(loss.item())
                with tracer.phase("backward"):
                    loss.backward()
                with tracer.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
            if len(walls) == step:
                walls.append(time.perf_counter() - t0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.freeze()  # skip the interpreter's last collection over torch's objects (~1 CPU-s a rank)
