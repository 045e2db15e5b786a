"""In-process instrumentation for training loops: timers, recorders, integrations, emitter.

    tracer = trainer_hooks.auto(model, optimizer)   # no step/phase blocks: trainer_hooks/auto.py
    tracer = trainer_hooks.Tracer()            # rank, world, run id, endpoint from the launcher/env
    with tracer.step(n):
        with tracer.phase("forward"): ...
    tracer.close()

DDP and FSDP modules are found at their first forward (``trainer_hooks.integrations.ddp``: DDP's gradient
buckets are timed through its comm hook). DeepSpeed: ``trainer_hooks.deepspeed.instrument(engine)``; Hugging Face:
``trainer_hooks.hf.TracetopCallback``; Lightning: ``trainer_hooks.lightning.TracetopCallback`` (each in
:mod:`trainer_hooks.integrations`).

Never imports the collector, the agent, the TUI, duckdb or textual (checked by a test)."""

from trainer_hooks.auto import Auto, auto
from trainer_hooks.bubble import bubble_rate, expected_bubble_rate
from trainer_hooks.identity import Identity, SetupError
from trainer_hooks.tracer import Tracer, tracing

__all__ = ["Auto", "Identity", "SetupError", "Tracer", "auto", "bubble_rate", "expected_bubble_rate", "tracing"]
