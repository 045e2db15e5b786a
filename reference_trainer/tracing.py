"""The seam between the reference trainer and tracetop's hooks.

The training loop calls :func:`start` once the DeepSpeed engine exists, wraps every
``engine.train_batch`` in ``tracing.step(n)`` and calls ``tracing.close()`` at the end (also on
error). This file is owned by the hooks (``trainer_hooks/``); until they are wired in, every
method is a no-op. Everything the hooks may need about the run arrives in ``meta``:

``world_size, tp, pp, dp, zero_stage, model_name, n_params, flops_per_token, micro_batch,
micro_batches, seq_len, ds_config (dict), topology (PipeModelDataParallelTopology or None),
stage (this rank's pipeline stage)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class Tracing:
    """No-op tracing: the interface the training loop relies on."""

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Context manager around one training step (one ``engine.train_batch``)."""
        yield

    def close(self) -> None:
        """Flush and stop; safe to call more than once."""


def start(engine: Any, args: Any, *, meta: dict[str, Any]) -> Tracing:
    """Begin tracing this rank's run; a no-op Tracing when ``args.no_trace`` is set."""
    del engine, meta
    if getattr(args, "no_trace", False):
        return Tracing()
    return Tracing()
