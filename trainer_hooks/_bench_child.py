"""One reference-trainer run for ``tracetop bench hooks``, hooks switched on and off in blocks.

``python -m trainer_hooks._bench_child OUT.json BLOCK <trainer flags>`` runs ``reference_trainer``
in this process with the hooks started as usual (``reference_trainer.tracing.start``), then
switched off and on every BLOCK steps in ABBA order (on/off, off/on, ...): "off" removes every
hook (collectives restored, the pipeline's instruction map and the optimizer's offload methods
unwrapped, no ``step`` context), "on" puts them back.

The trainer times each step with two ``time.perf_counter()`` calls; this wrapper lets them through
unchanged and notes the wall clock and the process CPU time (every thread: training, the hooks'
emitter and shipper, gloo) at the same two points. When an "on" block ends, everything it
recorded is drained and shipped at once (``flush``) and the CPU time of that is charged to the
block, so no work caused by an "on" block is done during an "off" one; the shipper's own timer
does not seal batches meanwhile, so each "on" block ships one batch per kind, as a steady run
does every flush interval (2 s; a block of the tiny model's 60 steps lasts about that long). The step that switches is
left out of the per-step figures, and so is the step after it. An "off" block begins after the
wait for the collector's acks; an "on" block begins after a sleep of the same length, so both
kinds of block start from the same idle pause. OUT gets, per step, (wall s, CPU s, on) and per block the
shipping CPU seconds.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import types
from pathlib import Path
from typing import Any


class _Switching:
    def __init__(self, traced: Any, engine: Any, block: int, log: dict[str, Any]) -> None:
        from trainer_hooks import collectives, offload, pipeline

        self.traced = traced
        self.tracer = traced.tracer
        # Batches are sealed only at the end of each "on" block (one per kind, as the shipper's
        # 2 s interval does in a steady run when a block lasts ~2 s), not also by the timer.
        self.tracer.shipper.flush_interval_s = 1e9
        self.engine = engine
        self.block = block
        self.log = log
        self.on = True
        self.block_index = -1
        self.last_pause_s = 0.0
        self._mods = (collectives, offload, pipeline)

    def _state_for(self, n: int) -> bool:
        b = n // self.block
        first_on = (b // 2) % 2 == 0  # ABBA: blocks (on, off), (off, on), (on, off), ...
        return first_on if b % 2 == 0 else not first_on

    def _switch(self, on: bool) -> None:
        collectives, offload, pipeline = self._mods
        t = self.tracer
        if on:
            time.sleep(self.last_pause_s)  # the same pause as before an "off" block: both start alike
            collectives.install(t)
            pipeline.wrap(self.engine, t)
            offload.wrap(getattr(self.engine, "optimizer", None), t)
        else:
            c0, w0 = time.process_time_ns(), time.perf_counter()
            t._drain()
            t.shipper.flush(30.0)
            self.last_pause_s = time.perf_counter() - w0
            self.log["ship_cpu_s"].append((self.block_index - 1, (time.process_time_ns() - c0) / 1e9))
            collectives.uninstall(t)
            pipeline.unwrap(self.engine)
            offload.unwrap(getattr(self.engine, "optimizer", None))
        self.on = on

    def step(self, n: int) -> Any:
        b = n // self.block
        if b != self.block_index:
            self.block_index = b
            want = self._state_for(n)
            if want != self.on:
                self._switch(want)
            self.log["switch_steps"].append(n)
        self.log["on"].append(self.on)
        return self.traced.step(n) if self.on else contextlib.nullcontext()

    def close(self) -> None:
        if self.on:
            c0 = time.process_time_ns()
            self.tracer._drain()
            self.tracer.shipper.flush(30.0)
            self.log["ship_cpu_s"].append((self.block_index, (time.process_time_ns() - c0) / 1e9))
        else:
            self._switch(True)  # put everything back so close() restores it
        self.traced.close()


def main(argv: list[str]) -> int:
    out, block, trainer_argv = Path(argv[0]), int(argv[1]), argv[2:]
    from reference_trainer import tracing as tracing_mod
    from reference_trainer import train

    log: dict[str, Any] = {"wall_s": [], "cpu_s": [], "on": [], "switch_steps": [], "ship_cpu_s": [], "block": block}
    marks: list[tuple[float, int]] = []
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})

    def perf_counter() -> float:
        now = time.perf_counter()
        marks.append((now, time.process_time_ns()))
        return now

    clock.perf_counter = perf_counter
    train.time = clock  # only the step timer of train.py reads it
    real_start = tracing_mod.start

    def start(engine: Any, args: Any, *, meta: dict[str, Any]) -> Any:
        traced = real_start(engine, args, meta=meta)
        return _Switching(traced, engine, block, log) if hasattr(traced, "tracer") else traced

    tracing_mod.start = start
    rc = train.main(trainer_argv)
    for (w0, c0), (w1, c1) in zip(marks[0::2], marks[1::2]):
        log["wall_s"].append(w1 - w0)
        log["cpu_s"].append((c1 - c0) / 1e9)
    out.write_text(json.dumps(log))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
