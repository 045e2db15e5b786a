"""One rank of the close-path benchmark (trainer_hooks/bench/close_path.py), launched by torchrun.

    torchrun --standalone --nproc_per_node 2 -m trainer_hooks.bench.close_loop --steps 40 --out DIR

A plain DDP loop with a Tracer (TRACETOP_ENDPOINT, TRACETOP_RUN_ID), then ``tracer.close()``, a
barrier and the process group's teardown, the way tests/trainer_hooks/user_loop.py ends. Each phase
of the end is stamped on the system-wide monotonic clock into ``DIR/rank{R}.json`` (the driver adds
the process's exit, seen through a pidfd): last step end, close start, close end, barrier end,
teardown end, the last atexit hook (and the CPU seconds spent by then). The process torchrun
starts is a thin parent of the loop, which writes the loop's exit and its CPU seconds in all
(``rank{R}.exit.json``): the difference is the interpreter's finalization, in CPU seconds. Inside the close, every ``Thread.join`` of a tracetop thread and
the steps of the close (``CommandBus.close``, ``Emitter.stop``, ``Shipper.flush``, ``Shipper.close``) are timed (name, seconds), so the wait is attributed to the thread it waited on.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

STAMPS: dict[str, Any] = {"pid": os.getpid(), "waits": []}
_CHILD = "TRACETOP_CLOSE_LOOP_CHILD"


def _timed_joins() -> None:
    """Record each join of a tracetop thread (and each shipper flush) with its duration."""
    join = threading.Thread.join

    def timed_join(self: threading.Thread, timeout: float | None = None) -> None:
        t0 = time.monotonic()
        join(self, timeout)
        if self.name.startswith("tracetop"):
            STAMPS["waits"].append((f"join {self.name}", round(time.monotonic() - t0, 4)))

    threading.Thread.join = timed_join  # type: ignore[method-assign]
    from tracetop.wire.shipper import Shipper
    from trainer_hooks.commands import CommandBus
    from trainer_hooks.emitter import Emitter

    for cls, name in ((Shipper, "flush"), (Shipper, "close"), (Emitter, "stop"), (CommandBus, "close")):
        _time_method(cls, name)


def _time_method(cls: type, name: str) -> None:
    fn = getattr(cls, name)

    def timed(self: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(self, *args, **kw)
        finally:
            STAMPS["waits"].append((f"{cls.__name__}.{name}", round(time.monotonic() - t0, 4)))

    setattr(cls, name, timed)


def _save(out: Path) -> None:
    """The stamps so far, replaced whole (a rank SIGTERMed mid-write leaves the previous ones)."""
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(STAMPS))
    os.replace(tmp, out)


def _wrap() -> int:
    """The rank's process as torchrun sees it: runs the loop as its child and writes what only a
    parent sees (the child's exit on the monotonic clock, its CPU seconds in all) to
    ``rank{R}.exit.json``; a signal torchrun sends is handed to the child."""
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    child = subprocess.Popen([sys.executable, "-m", "trainer_hooks.bench.close_loop", *sys.argv[1:]],
                             env=dict(os.environ, **{_CHILD: "1"}))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:
            continue
    exit_mono = time.monotonic()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.exit.json").write_text(
        json.dumps({"exit": exit_mono, "cpu_s": ru.ru_utime + ru.ru_stime, "rc": rc}))
    return 128 - rc if rc < 0 else rc


def main() -> None:
    if os.environ.get(_CHILD) != "1":
        raise SystemExit(_wrap())
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-close", action="store_true", help="leave the close to the atexit hook")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() as the last atexit hook: the interpreter's final collection skips every object")
    a = ap.parse_args()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = a.out / f"rank{rank}.json"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"rank{rank}.pid").write_text(str(os.getpid()))

    def save() -> None:
        STAMPS["atexit_last"] = time.monotonic()
        cpu = os.times()
        STAMPS["atexit_cpu_s"] = cpu.user + cpu.system
        _save(out)

    if a.gc_freeze:
        import gc

        atexit.register(gc.freeze)
    atexit.register(save)  # before the Tracer's: runs after it (atexit is last in, first out)
    _timed_joins()
    import trainer_hooks

    tracer = trainer_hooks.Tracer()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                                          torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(a.steps):
        with tracer.step(step):
            with tracer.phase("forward"):
                time.sleep(a.sleep_ms / 1000)
                loss = model(torch.randn(4, 32)).square().mean()
            with tracer.phase("backward"):
                loss.backward()
            with tracer.phase("optimizer"):
                opt.step()
                opt.zero_grad()
        STAMPS["last_step_end"] = time.monotonic()
        _save(out)
    if not a.no_close:
        STAMPS["close_start"] = time.monotonic()
        tracer.close()
        STAMPS["close_end"] = time.monotonic()
    dist.barrier()
    STAMPS["barrier_end"] = time.monotonic()
    dist.destroy_process_group()
    STAMPS["teardown_end"] = time.monotonic()
    STAMPS["stats"] = {k: v for k, v in tracer.stats().items() if isinstance(v, (int, bool))}
    _save(out)


if __name__ == "__main__":
    main()
