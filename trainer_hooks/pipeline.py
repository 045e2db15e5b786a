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

from trainer_hooks.tracer import INSTRUCTIONS, Tracer


def _wrap_handler(tracer: Tracer, instr: str, handler: Any) -> Any:
    slot, _, has_mb = INSTRUCTIONS.get(instr, (4, "comm", False))

    def timed(engine: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            token = tracer._instr_enter(instr, slot)
        except Exception as e:
            tracer._hook_error("pipeline", e)
            return handler(engine, *args, **kwargs)
        try:
            return handler(engine, *args, **kwargs)
        finally:
            try:
                tracer._instr_exit(instr, slot, token, has_mb)
            except Exception as e:
                tracer._hook_error("pipeline", e)

    timed.__name__ = getattr(handler, "__name__", instr)
    timed.__wrapped__ = handler  # type: ignore[attr-defined]
    return timed


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
