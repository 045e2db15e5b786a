"""Pipeline instruction timing on DeepSpeed's PipelineEngine, without editing DeepSpeed.

``PipelineEngine._exec_schedule`` looks each instruction's handler up in
``self._INSTRUCTION_MAP`` and binds it to the engine (``MethodType(handler, self)``). An instance
attribute of that name holding wrapped handlers shadows the class table: every instruction of
every step is timed on this rank, and :func:`unwrap` removes the attribute again.

Each instruction gives one PIPE_INSTR row (stage, micro-batch = its index among the step's
instructions of that type, duration including any wait inside it) and feeds the STEP row's phase
sums: ForwardPass -> forward, BackwardPass -> backward, OptimizerStep -> optimizer,
LoadMicroBatch -> data wait; send/recv/reduce instructions are communication (their collectives
are counted by the collective wrapper).
"""

from __future__ import annotations

from typing import Any

from trainer_hooks.tracer import INSTRUCTIONS, Tracer, perf_counter_ns


def _wrap_handler(tracer: Tracer, instr: str, handler: Any) -> Any:
    slot, phase, has_mb = INSTRUCTIONS.get(instr, (4, "comm", False))
    code = tracer._instr_code(instr)
    counts = tracer._instr_counts
    clock = perf_counter_ns

    def timed(engine: Any, *args: Any, **kwargs: Any) -> Any:
        t = tracer
        if t._cuda is not None:
            return _device_timed(t, instr, slot, has_mb, handler, engine, args, kwargs)
        # CPU: the hot path, inlined. Self time = wall time minus the collectives inside.
        try:
            mb = counts.get(instr, 0)
            counts[instr] = mb + 1
            prev = t.current_phase
            t.current_phase = phase
            acc = t._acc
            comm0 = acc.comm_ns
        except Exception as e:  # a hook never breaks the instruction it observes
            t._hook_error("pipeline", e)
            return handler(engine, *args, **kwargs)
        t0 = clock()
        try:
            return handler(engine, *args, **kwargs)
        finally:
            dur = clock() - t0
            try:
                t.current_phase = prev
                acc.sums[slot] += dur - (acc.comm_ns - comm0)
                t._ri.append((t.step_n, t._step_wall0 + (t0 - t._step_perf0), dur, mb if has_mb else -1, code))
                t.events += 1
            except Exception as e:
                t._hook_error("pipeline", e)

    timed.__name__ = getattr(handler, "__name__", instr)
    timed.__wrapped__ = handler  # type: ignore[attr-defined]
    return timed


def _device_timed(t: Tracer, instr: str, slot: int, has_mb: bool, handler: Any, engine: Any, args: tuple,
                  kwargs: dict) -> Any:
    """GPU: CUDA events around the instruction, resolved later by the emitter."""
    try:
        token = t._instr_enter(instr, slot)
    except Exception as e:
        t._hook_error("pipeline", e)
        return handler(engine, *args, **kwargs)
    try:
        return handler(engine, *args, **kwargs)
    finally:
        try:
            t._instr_exit(instr, slot, token, has_mb)
        except Exception as e:
            t._hook_error("pipeline", e)


def wrap(engine: Any, tracer: Tracer) -> bool:
    """Shadow the engine's instruction map with timed handlers. False if it has none."""
    table = getattr(type(engine), "_INSTRUCTION_MAP", None)
    if not isinstance(table, dict) or not tracer.enabled:
        return False
    engine._INSTRUCTION_MAP = {cls: _wrap_handler(tracer, cls.__name__, fn) for cls, fn in table.items()}
    return True


def unwrap(engine: Any) -> None:
    if "_INSTRUCTION_MAP" in getattr(engine, "__dict__", {}):
        del engine._INSTRUCTION_MAP
