"""One rank whose process the test ends by signal (tests/trainer_hooks/test_shutdown.py).

    python exit_probe.py MODE STEPS_FILE [STORE_FILE]

It runs steps with a Tracer (TRACETOP_ENDPOINT, TRACETOP_RUN_ID), appending each completed step to
STEPS_FILE, and prints ``ready`` once 20 are done. Then, by MODE:

* ``default``: goes on stepping, no handler of its own (SIGTERM's default action ends it);
* ``handler``: a SIGTERM handler installed *before* the Tracer prints ``previous handler`` and
  exits with status 7 (a framework's graceful stop);
* ``stuck``: enters a gloo barrier that never completes (its peer, ``peer`` mode with the same
  STORE_FILE, never joins it): the main thread is in C and runs no Python handler;
* ``peer``: rank 1 of that group: joins it and sleeps;
* ``garbage``: as ``default``, but every step leaves a cycle whose ``__del__`` runs 20 ms of Python
  and collects it: most of the time the main thread is inside a ``__del__``, where an exception
  (a ``KeyboardInterrupt``) is printed and dropped.
"""

from __future__ import annotations

import faulthandler
import gc
import signal
import sys
import time
from datetime import timedelta


class _Cycle:
    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.02:
            pass


def main() -> None:
    mode, steps_file = sys.argv[1], sys.argv[2]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waited too long asks where it is
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # started under a job that ignores SIGINT (a non-interactive shell's `cmd &` does; the child
        # inherits it and Python then installs no handler, so SIGINT would not end the process, with
        # or without the hooks): start as a launcher's rank does, with Python's own
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if mode in ("stuck", "peer"):
        import torch.distributed as dist

        store = dist.FileStore(sys.argv[3], 2)
        dist.init_process_group("gloo", store=store, rank=0 if mode == "stuck" else 1, world_size=2,
                                timeout=timedelta(seconds=300))
        if mode == "peer":
            print("ready", flush=True)
            time.sleep(600)
            return
    if mode == "handler":
        def stop(signum: int, frame: object) -> None:
            print("previous handler", flush=True)
            sys.exit(7)

        signal.signal(signal.SIGTERM, stop)

    import trainer_hooks

    tracer = trainer_hooks.Tracer(rank=0, world_size=1 if mode != "stuck" else 2, device="cpu",
                                  wrap_collectives=False)
    log = open(steps_file, "a", buffering=1)  # noqa: SIM115
    step = 0
    while True:
        with tracer.step(step):
            with tracer.phase("forward"):
                time.sleep(0.01)
            if mode == "garbage":
                _Cycle()
                gc.collect()
        log.write(f"{step}\n")
        step += 1
        if step == 20:
            print("ready", flush=True)
            if mode == "stuck":
                import torch.distributed as dist

                dist.barrier()  # the peer never joins: blocked in C until the 300 s timeout


if __name__ == "__main__":
    main()
