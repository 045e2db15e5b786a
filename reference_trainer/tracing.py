"""The seam between the reference trainer and tracetop's hooks.

The training loop calls :func:`start` once the DeepSpeed engine exists, wraps every
``engine.train_batch`` in ``tracing.step(n)`` and calls ``tracing.close()`` at the end (also on
error). This file is owned by the hooks (``trainer_hooks/``). Everything the hooks need about the
run arrives in ``meta``:

``world_size, tp, pp, dp, zero_stage, model_name, n_params, flops_per_token, micro_batch,
micro_batches, seq_len, ds_config (dict), topology (PipeModelDataParallelTopology or None),
stage (this rank's pipeline stage)``.

Where events go: ``TRACETOP_ENDPOINT`` (a collector or an agent socket); ``TRACETOP_DISABLE=1`` or
``--no-trace`` turns the hooks off.
"""

from __future__ import annotations

import contextlib
from typing import Any


class Tracing:
    """No-op tracing: the interface the training loop relies on."""

    def step(self, n: int) -> Any:
        """Context manager around one training step (one ``engine.train_batch``)."""
        return contextlib.nullcontext()

    def set_loss(self, loss: float) -> None:
        """The current step's loss (call inside ``step(n)``)."""

    def close(self) -> None:
        """Flush and stop; safe to call more than once."""


class Traced(Tracing):
    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self._bus = getattr(tracer, "commands", None)  # trainer_hooks.commands.CommandBus (enabled tracers)
        self._pending: Any = None

    def step(self, n: int) -> Any:
        return self.tracer.step(n)

    def set_loss(self, loss: float) -> None:
        self.tracer.set_loss(loss)

    # The control path (trainer_hooks/commands.py): every rank, every step boundary.
    def adjustments(self, step: int) -> list[tuple[str, Any]]:
        """The command all ranks received at this boundary (one gloo broadcast every K steps)."""
        bus = self._bus
        if bus is None:
            return []
        k = bus.every_steps
        if k > 0 and step % k and bus.external:  # not a boundary (9 steps in 10): one flag test, no call
            return []
        bus.external = True
        self._pending = bus.receive(step)
        if self._pending is not None and self._pending.key == "profile":  # the hooks' own: nothing to adjust
            bus.profile(self._pending)
            self._pending = None
            return []
        return [(self._pending.key, self._pending.value)] if self._pending is not None else []

    def adjustment_result(self, step: int, key: str, value: Any, applied: bool, message: str) -> bool:
        """This rank's outcome; True when every rank applied it (False: undo it here)."""
        if self._bus is None or self._pending is None:
            return applied
        return self._bus.settle(self._pending, applied, message)

    def adjustment_undone(self, step: int, key: str, value: Any, ok: bool, message: str) -> None:
        if self._bus is not None and self._pending is not None:
            self._bus.undone(self._pending, ok, message)

    def close(self) -> None:
        self.tracer.close()


def start(engine: Any, args: Any, *, meta: dict[str, Any]) -> Tracing:
    """Begin tracing this rank's run; a no-op Tracing when ``args.no_trace`` is set."""
    if getattr(args, "no_trace", False):
        return Tracing()
    from trainer_hooks.integrations.deepspeed import instrument

    meta = dict(meta)
    pipelined = int(meta.get("pp", 1)) > 1
    # The ZeRO shape (no pipeline) runs forward/backward/step itself: time those three calls.
    budget_mb = getattr(args, "memory_budget_mb", None)
    budget = {"memory_budget_bytes": int(budget_mb * 2**20)} if budget_mb else {}
    tracer = instrument(engine, meta=meta, phases=not pipelined, **budget)
    return Traced(tracer) if tracer.enabled else Tracing()
