"""A plain DDP loop (gloo, under torchrun) for the first-failure and never-heard tests: the hooks
as trainer_hooks/README.md shows them (``Tracer`` as a context manager, ``step``, ``phase``).

    torchrun --standalone --nproc_per_node 4 tests/collector/live/failure_loop.py --steps 40 --kill 3@20

--kill R@S      rank R sends itself SIGKILL in its forward of step S (no clean close)
--late R:SEC    rank R sleeps SEC seconds after the DDP model is built, before its Tracer starts
--die-early R   rank R exits (os._exit(1)) 3 s after the DDP model is built, before its Tracer starts
--slow-data R:MS@S  rank R's data loading takes MS ms longer (inside its data phase) from step S
--step-ms MS    each step computes about MS ms (sleep inside forward), default 30
--timeout-s S   the process group's timeout (a survivor blocked in a collective with the dead rank
                errors out after S s and closes its hooks; below torchrun's 30 s SIGTERM grace)

Every rank ends through its own SIGTERM handler (SystemExit: the ``with`` block closes the hooks),
as a preemption-aware trainer does, or through the error its collective with the dead rank raises
(at once, or at --timeout-s where gloo blocks holding the GIL, which no signal handler interrupts):
the launcher's teardown after a failed rank is then a clean close on the survivors, and the failed
rank alone ends without one. (Without either, whether a survivor's last rows left after the kill
is chance until the hooks flush on SIGTERM themselves; first_failure names the earliest heard.)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill", default="")
    ap.add_argument("--late", default="")
    ap.add_argument("--die-early", type=int, default=-1)
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--timeout-s", type=float, default=0.0)
    ap.add_argument("--slow-data", default="")
    a = ap.parse_args()
    import torch.distributed as dist

    import trainer_hooks

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.timeout_s:
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)))
    if a.die_early == rank:
        time.sleep(3.0)  # the others are past the DDP constructor's collectives and start their hooks
        os._exit(1)
    if a.late:
        r, sec = a.late.split(":")
        if int(r) == rank:
            time.sleep(float(sec))
    kill_rank, kill_step = (int(x) for x in a.kill.split("@")) if a.kill else (-1, -1)
    data_rank, data_ms, data_from = -1, 0.0, 0
    if a.slow_data:
        r, rest = a.slow_data.split(":")
        ms, s = rest.split("@")
        data_rank, data_ms, data_from = int(r), float(ms), int(s)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with trainer_hooks.Tracer() as tracer:
        for step in range(a.steps):
            with tracer.step(step):
                with tracer.phase("data"):
                    if rank == data_rank and step >= data_from:
                        time.sleep(data_ms / 1e3)
                    x = torch.randn(8, 64, generator=gen)
                with tracer.phase("forward"):
                    if rank == kill_rank and step == kill_step:
                        print(f"[failure_loop] rank {rank}: SIGKILL at step {step}", flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(a.step_ms / 1e3)
                    loss = model(x).pow(2).mean()
                with tracer.phase("backward"):
                    loss.backward()
                with tracer.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
