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

import inspect
from typing import TYPE_CHECKING, Any

from trainer_hooks.recorder import INSTRUCTIONS, Recorder, perf_counter_ns

if TYPE_CHECKING:
    from trainer_hooks.tracer import Tracer


#: "no such argument": DeepSpeed calls most handlers as ``handler(engine, buffer_id=i)``
_ABSENT: Any = object()


def _call(handler: Any, engine: Any, buffer_id: Any, args: tuple, kwargs: dict) -> Any:
    """The handler called with exactly what the timed wrapper was given."""
    if buffer_id is _ABSENT:
        return handler(engine, *args, **kwargs)
    return handler(engine, *args, buffer_id=buffer_id, **kwargs)


def _buffer_id_first(handler: Any) -> bool:
    """The handler's first parameter after the engine is ``buffer_id`` (DeepSpeed's buffer
    instructions): then ``handler(engine, buffer_id)`` is the same call as with the keyword."""
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    return (len(params) >= 2 and params[1].name == "buffer_id"
            and params[1].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _simple(handler: Any) -> bool:
    """The handler takes the engine alone, or the engine and ``buffer_id`` (DeepSpeed's handlers but
    ``OptimizerStep``): ``timed(engine, buffer_id=_ABSENT)`` then accepts every call the handler
    accepts and passes it on as it came, with no ``*args``/``**kwargs`` (a function with ``**kwargs``
    makes a dict at every call)."""
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in plain:
        return False
    return len(params) == 1 or (len(params) == 2 and params[1].name == "buffer_id"
                                and params[1].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _wrap_handler(rec: Recorder, instr: str, handler: Any, simple: bool = True) -> Any:
    slot, phase, has_mb = INSTRUCTIONS.get(instr, (4, "comm", False))
    code = rec.instr_code(instr)
    if simple and _simple(handler):
        return _wrap_simple(rec, instr, handler, slot, phase, has_mb, code)
    # the Recorder's objects that live as long as it (reset in place): bound once, not looked up per call
    counts, acc, add_row = rec.instr_counts, rec.acc, rec.instr_rows.extend
    sums = acc.sums
    clock = perf_counter_ns
    positional = _buffer_id_first(handler)

    # ``buffer_id`` named: DeepSpeed's ``handler(engine, buffer_id=i)`` (12 of a step's 15
    # instructions with 4 micro-batches) is passed on as ``handler(engine, buffer_id)``, without
    # building and unpacking a keyword dict (~2.5 us a call between steps of tensor work, measured
    # in the reference trainer's conditions); every other call exactly as it came (``_call``)
    def timed(engine: Any, *args: Any, buffer_id: Any = _ABSENT, **kwargs: Any) -> Any:
        r = rec
        if r.device_clock is not None:
            return _device_timed(r, instr, slot, has_mb, handler, engine, buffer_id, args, kwargs)
        # CPU: the hot path, inlined. Self time = wall time minus the collectives inside.
        try:
            if has_mb:
                mb = counts[code]
                counts[code] = mb + 1
            else:
                mb = -1
            prev = r.current_phase
            r.current_phase = phase
            comm0 = acc.comm_ns
        except Exception as e:  # a hook never breaks the instruction it observes
            r.hook_error("pipeline", e)
            return _call(handler, engine, buffer_id, args, kwargs)
        t0 = clock()
        try:
            if args or kwargs:
                return _call(handler, engine, buffer_id, args, kwargs)
            if buffer_id is _ABSENT:  # OptimizerStep, ReduceGrads: no arguments
                return handler(engine)
            return handler(engine, buffer_id) if positional else handler(engine, buffer_id=buffer_id)
        finally:
            dur = clock() - t0
            try:
                r.current_phase = prev
                comm = acc.comm_ns
                sums[slot] += dur if comm == comm0 else dur - (comm - comm0)
                add_row((r.step_n, r.step_off + t0, dur, mb, code))
            except Exception as e:
                r.hook_error("pipeline", e)

    timed.__name__ = getattr(handler, "__name__", instr)
    timed.__wrapped__ = handler  # type: ignore[attr-defined]
    return timed


def _wrap_simple(rec: Recorder, instr: str, handler: Any, slot: int, phase: str, has_mb: bool, code: int) -> Any:
    """``_wrap_handler``'s timed handler for a handler of ``(engine)`` or ``(engine, buffer_id)``:
    the same hot path, its arguments bound by the interpreter (no keyword dict a call)."""
    counts, acc, add_row = rec.instr_counts, rec.acc, rec.instr_rows.extend
    sums = acc.sums
    clock = perf_counter_ns

    def timed(engine: Any, buffer_id: Any = _ABSENT) -> Any:
        r = rec
        if r.device_clock is not None:
            return _device_timed(r, instr, slot, has_mb, handler, engine, buffer_id, (), {})
        try:
            if has_mb:
                mb = counts[code]
                counts[code] = mb + 1
            else:
                mb = -1
            prev = r.current_phase
            r.current_phase = phase
            comm0 = acc.comm_ns
        except Exception as e:  # a hook never breaks the instruction it observes
            r.hook_error("pipeline", e)
            return handler(engine) if buffer_id is _ABSENT else handler(engine, buffer_id)
        t0 = clock()
        try:
            return handler(engine) if buffer_id is _ABSENT else handler(engine, buffer_id)
        finally:
            dur = clock() - t0
            try:
                r.current_phase = prev
                comm = acc.comm_ns
                sums[slot] += dur if comm == comm0 else dur - (comm - comm0)
                add_row((r.step_n, r.step_off + t0, dur, mb, code))
            except Exception as e:
                r.hook_error("pipeline", e)

    timed.__name__ = getattr(handler, "__name__", instr)
    timed.__wrapped__ = handler  # type: ignore[attr-defined]
    return timed


def _device_timed(r: Recorder, instr: str, slot: int, has_mb: bool, handler: Any, engine: Any, buffer_id: Any,
                  args: tuple, kwargs: dict) -> Any:
    """GPU: CUDA events around the instruction, resolved later by the emitter."""
    try:
        token = r.instr_enter(instr)
    except Exception as e:
        r.hook_error("pipeline", e)
        return _call(handler, engine, buffer_id, args, kwargs)
    try:
        return _call(handler, engine, buffer_id, args, kwargs)
    finally:
        try:
            r.instr_exit(instr, slot, token, has_mb)
        except Exception as e:
            r.hook_error("pipeline", e)


def wrap(engine: Any, tracer: Tracer, *, simple: bool = True) -> bool:
    """Shadow the engine's instruction map with timed handlers. False if it has none.
    ``simple=False``: every handler in the general form (tests compare the two forms' rows)."""
    table = getattr(type(engine), "_INSTRUCTION_MAP", None)
    if not isinstance(table, dict) or not tracer.enabled:
        return False
    rec = tracer.recorder
    engine._INSTRUCTION_MAP = {cls: _wrap_handler(rec, cls.__name__, fn, simple) for cls, fn in table.items()}
    return True


def unwrap(engine: Any) -> None:
    if "_INSTRUCTION_MAP" in getattr(engine, "__dict__", {}):
        del engine._INSTRUCTION_MAP
