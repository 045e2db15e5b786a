"""One reference-trainer run for ``tracetop bench hooks``, hooks switched on and off every few steps.

``python -m reference_trainer.bench.hooks_child OUT.json BLOCK WARMUP SEED [--aa] <trainer flags>`` runs
``reference_trainer`` in this process with the hooks started as usual
(``reference_trainer.tracing.start``), then switched off and on every BLOCK steps, in quads of
four blocks ordered ABBA or BAAB at random (seeded by SEED): "off" removes every hook from the training thread (collectives restored,
the pipeline's instruction map and the optimizer's offload methods unwrapped, no ``step``
context), "on" puts them back (``--aa``: an A/A control, every hook off throughout and only the
blocks' labels alternating, to check that the estimate reads zero when nothing differs). The hooks' threads (emitter, shipper, gRPC) keep running
throughout, as they would in production, on their own timers.

The trainer times each step with two ``time.perf_counter()`` calls; this wrapper lets them through
unchanged and notes, at the same two points, the wall clock, the process CPU time and the
training thread's CPU time. A switch happens just before a step's first reading, outside every
measured interval. OUT gets, per step, (wall s, process CPU s, training-thread CPU s, on), and
for the measured window (the steps after WARMUP) the CPU time of the threads the hooks started:
process CPU minus the training thread's minus that of every thread that already existed before the
hooks started (torch's, gloo's). That figure is exact, whichever step it fell in, and includes
threads that exited meanwhile (the process clock keeps their time).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any


def _thread_cpu_ns(tids: set[int]) -> dict[int, int]:
    """CPU time of each of this process's threads still alive among tids (Linux schedstat, ns)."""
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def _thread_names(tids: set[int]) -> list[str]:
    py = {t.native_id: t.name for t in threading.enumerate()}
    names = []
    for tid in sorted(tids):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(py.get(tid) or f.read().strip())
        except OSError:
            pass
    return names


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


class _Switching:
    """Takes the hooks off the training thread and puts them back by swapping prebuilt objects:
    the collective wrappers and the originals, the timed and the plain instruction maps (the
    engine keeps an ``_INSTRUCTION_MAP`` attribute either way, so its ``__dict__`` never changes
    shape). Nothing is allocated and nothing is rebuilt, so a switch leaves the caches as they
    were; rebuilding the wrappers at every switch (install/uninstall) made the first "on" step
    after it ~100 us slower here, which an always-on run never pays."""

    def __init__(self, traced: Any, engine: Any, block: int, seed: int = 0) -> None:
        from trainer_hooks.integrations import collectives, offload

        self.traced = traced
        self.tracer = traced.tracer
        self.engine = engine
        self.block = block
        self.on = True
        self.aa = False
        self._rng = random.Random(seed)
        self._flips: list[bool] = []
        self._collectives = collectives
        # (object, attribute, value with hooks on, value with hooks off)
        swaps: list[tuple[Any, str, Any, Any]] = []
        for (mod, name), original in collectives.originals().items():
            swaps.append((mod, name, getattr(mod, name), original))
        comm = sys.modules.get("deepspeed.comm.comm")
        cdb = getattr(comm, "cdb", None) if comm is not None else None
        for attr, original in collectives.deepspeed_originals().items():
            if cdb is not None:
                swaps.append((cdb, attr, getattr(cdb, attr), original))
        timed_map = engine.__dict__.get("_INSTRUCTION_MAP")
        if timed_map is not None:
            swaps.append((engine, "_INSTRUCTION_MAP", timed_map, type(engine)._INSTRUCTION_MAP))
        optimizer = getattr(engine, "optimizer", None)
        for name in getattr(optimizer, offload.WRAPPED_ATTR, None) or []:
            swaps.append((optimizer, name, optimizer.__dict__[name], getattr(type(optimizer), name).__get__(optimizer)))
        if "train_batch" in engine.__dict__:  # the loss wrapper (trainer_hooks.integrations.deepspeed._wrap_train_batch)
            swaps.append((engine, "train_batch", engine.__dict__["train_batch"], type(engine).train_batch.__get__(engine)))
        self._swaps = swaps

    def state_for(self, n: int) -> bool:
        """Quads of 4 blocks, each ABBA or BAAB at random (seeded): step times here have periodic
        parts (the garbage collector, for one, runs every so many allocations) that a fixed
        pattern of short blocks aliases into the estimate; a random orientation makes them noise."""
        q, b = divmod(n // self.block, 4)
        while len(self._flips) <= q:
            self._flips.append(self._rng.random() < 0.5)
        return (b in (0, 3)) != self._flips[q]

    def before_step(self, n: int) -> None:
        want = self.state_for(n)
        if want == self.on:
            return
        if self.aa:  # A/A control: the hooks stay off, only the label changes
            self.on = want
            return
        self._apply(want)

    def _apply(self, on: bool) -> None:
        for obj, attr, on_value, off_value in self._swaps:
            setattr(obj, attr, on_value if on else off_value)
        self._collectives.route_to(self.tracer.recorder if on else None)
        self.on = on

    def step(self, n: int) -> Any:
        return self.traced.step(n) if self.on and not self.aa else contextlib.nullcontext()

    def set_loss(self, loss: float) -> None:
        if self.on and not self.aa:
            self.traced.set_loss(loss)

    # the command path (trainer_hooks/commands.py) runs in the "on" blocks, as in production
    def adjustments(self, n: int) -> Any:
        return self.traced.adjustments(n) if self.on and not self.aa else []

    def adjustment_result(self, *a: Any) -> Any:
        return self.traced.adjustment_result(*a)

    def control(self) -> None:
        """A/A: take every hook off for good; blocks keep their on/off labels (checks the estimator)."""
        self._apply(False)
        self.aa = True

    def close(self) -> None:
        if self.aa or not self.on:
            self.aa = False
            self._apply(True)  # put everything back so close() restores it
        self.traced.close()


def main(argv: list[str]) -> int:
    aa = "--aa" in argv
    argv = [a for a in argv if a != "--aa"]
    out, block, warmup, seed, trainer_argv = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4:]
    from reference_trainer import tracing as tracing_mod
    from reference_trainer import train

    state: dict[str, Any] = {"switching": None, "n": 0, "base_tids": set(), "window": []}
    marks: list[tuple[float, int, int]] = []
    on: list[bool] = []
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})

    def snapshot() -> dict[str, Any]:
        base = _thread_cpu_ns(state["base_tids"])
        hooks = _thread_cpu_ns(_tids() - state["base_tids"] - {threading.get_native_id()})
        return {"process_ns": time.process_time_ns(), "main_ns": time.thread_time_ns(), "base": base, "hooks": hooks,
                "wall_s": time.perf_counter()}

    def perf_counter() -> float:
        starting = len(marks) % 2 == 0
        if starting:
            n = state["n"]
            sw = state["switching"]
            if n == warmup:
                state["window"].append(snapshot())
            if sw is not None:
                sw.before_step(n)
                on.append(sw.on)
            else:
                on.append(False)
            state["n"] = n + 1
        now = time.perf_counter()
        marks.append((now, time.process_time_ns(), time.thread_time_ns()))
        return now

    clock.perf_counter = perf_counter
    train.time = clock  # only the step timer of train.py reads it
    real_start = tracing_mod.start

    def start(engine: Any, args: Any, *, meta: dict[str, Any]) -> Any:
        state["base_tids"] = _tids() - {threading.get_native_id()}
        traced = real_start(engine, args, meta=meta)
        if not hasattr(traced, "tracer"):
            return traced
        state["switching"] = sw = _Switching(traced, engine, block, seed)
        if aa:
            sw.control()
        return sw

    tracing_mod.start = start
    real_close = _Switching.close

    def close(self: _Switching) -> None:
        if len(state["window"]) == 1:  # the end of the last measured step: before close() flushes
            state["window"].append(snapshot())
            a, b = state["window"]
            names = dict(zip(sorted(b["hooks"]), _thread_names(set(b["hooks"]))))
            state["hook_threads"] = {f"{names.get(t, t)} [{t}]": (ns - a["hooks"].get(t, 0)) / 1e9 for t, ns in b["hooks"].items()}
            # a thread that ended inside the window (gRPC starts two per stream) is in the total only
        real_close(self)

    _Switching.close = close  # type: ignore[method-assign]
    rc = train.main(trainer_argv)
    if rc:
        return rc
    log: dict[str, Any] = {"block": block, "warmup": warmup, "seed": seed, "wall_s": [], "cpu_s": [], "thread_cpu_s": [], "on": on}
    for (w0, c0, t0), (w1, c1, t1) in zip(marks[0::2], marks[1::2]):
        log["wall_s"].append(w1 - w0)
        log["cpu_s"].append((c1 - c0) / 1e9)
        log["thread_cpu_s"].append((t1 - t0) / 1e9)
    if len(state["window"]) == 2:
        a, b = state["window"]
        base = sum(b["base"][t] - a["base"][t] for t in b["base"] if t in a["base"])
        process, main_ = b["process_ns"] - a["process_ns"], b["main_ns"] - a["main_ns"]
        log["window"] = {
            "steps": len(on) - warmup, "on_steps": sum(on[warmup:]),
            "process_cpu_s": process / 1e9, "main_cpu_s": main_ / 1e9, "base_threads_cpu_s": base / 1e9,
            "hook_threads_cpu_s": (process - main_ - base) / 1e9, "wall_s": b["wall_s"] - a["wall_s"],
            "hook_threads": state.get("hook_threads", []),
        }
    out.write_text(json.dumps(log))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
