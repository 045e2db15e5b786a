"""Hugging Face ``transformers`` integration: ``trainer_hooks.hf.TracetopCallback``.

    from trainer_hooks.hf import TracetopCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TracetopCallback()])

Every optimizer step is one tracetop step (``state.global_step``). Phases: ``forward`` from the
model's forward pre-hook to its forward hook, ``backward`` from there to the next forward or to the
optimizer, ``optimizer`` between ``on_pre_optimizer_step`` and ``on_optimizer_step`` (transformers
>= 4.47; older versions leave the optimizer inside ``backward``). Collectives are timed by the
Tracer (DDP's gradient buckets through its comm hook, see :mod:`trainer_hooks.integrations.ddp`); the Tracer is
made when the Trainer is (``on_init_end``), before ``train()`` wraps the model. Importing this
module needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # a setup error: say what to install
    raise ImportError("trainer_hooks.integrations.hf needs the transformers package: pip install transformers") from e

from trainer_hooks.tracer import Tracer


class TracetopCallback(TrainerCallback):
    """Traces a ``transformers.Trainer`` run on every rank. ``tracer`` or Tracer keyword arguments."""

    def __init__(self, tracer: Tracer | None = None, **tracer_kwargs: Any) -> None:
        self.tracer = tracer
        self._kwargs = tracer_kwargs
        self._handles: list[Any] = []

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # before train() wraps the model: DDP's start-up broadcast is seen, and a comm hook
        # accelerate registers (DistributedDataParallelKwargs(comm_hook=...)) is timed
        if self.tracer is None:
            self.tracer = Tracer(**self._kwargs)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.tracer is None:
            self.tracer = Tracer(**self._kwargs)
        t = self.tracer
        seq_len = int(getattr(getattr(model, "config", None), "max_position_embeddings", -1) or -1)
        t.describe(
            model_name=type(model).__name__ if model is not None else "",
            n_params=sum(p.numel() for p in model.parameters()) if model is not None else -1,
            micro_batch=int(args.per_device_train_batch_size), micro_batches=int(args.gradient_accumulation_steps),
            seq_len=seq_len, integration="hf",
        )
        if model is not None and t.enabled:

            def before_forward(*_: Any) -> None:  # returns None: the hook must not change the input
                if t.in_step:
                    t.switch_phase("forward")

            def after_forward(*_: Any) -> None:  # returns None: the hook must not change the output
                if t.in_step:
                    t.switch_phase("backward")

            self._handles = [model.register_forward_pre_hook(before_forward), model.register_forward_hook(after_forward)]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracer is not None:
            self.tracer.begin_step(int(state.global_step))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracer is not None:
            self.tracer.switch_phase("optimizer")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracer is not None:
            self.tracer.switch_phase(None)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracer is not None:
            self.tracer.end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.tracer is not None:
            self.tracer.end_step()
            self.tracer.close()
