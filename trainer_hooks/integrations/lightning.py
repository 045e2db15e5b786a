"""PyTorch Lightning integration: ``trainer_hooks.lightning.TracetopCallback``.

    from trainer_hooks.lightning import TracetopCallback
    trainer = L.Trainer(callbacks=[TracetopCallback()])

Every training batch is one tracetop step (``trainer.global_step`` at its start). Phases:
``forward`` from ``on_train_batch_start`` to ``on_before_backward``, ``backward`` to
``on_after_backward``, ``optimizer`` from ``on_before_optimizer_step`` to the batch end.
Collectives are timed by the Tracer (DDP's gradient buckets through its comm hook, see
:mod:`trainer_hooks.integrations.ddp`). The Tracer is made in ``setup`` (stage ``fit``), before the strategy
wraps the model. Needs ``lightning`` (or the older ``pytorch_lightning``).
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as e:  # a setup error: say what to install
        raise ImportError("trainer_hooks.integrations.lightning needs lightning: pip install lightning") from e

from trainer_hooks.tracer import Tracer


class TracetopCallback(Callback):
    """Traces a Lightning run on every rank. ``tracer`` or Tracer keyword arguments."""

    def __init__(self, tracer: Tracer | None = None, **tracer_kwargs: Any) -> None:
        super().__init__()
        self.tracer = tracer
        self._kwargs = tracer_kwargs

    def _make_tracer(self, trainer: Any) -> Tracer:
        if self.tracer is None:
            kw = dict(self._kwargs)
            kw.setdefault("rank", int(trainer.global_rank))
            kw.setdefault("world_size", int(trainer.world_size))
            self.tracer = Tracer(**kw)
        return self.tracer

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # before the strategy wraps the model: DDP's start-up broadcast is seen, and a comm hook
        # the strategy registers (DDPStrategy(ddp_comm_hook=...)) is timed
        if stage == "fit":
            self._make_tracer(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._make_tracer(trainer).describe(
            model_name=type(pl_module).__name__, n_params=sum(p.numel() for p in pl_module.parameters()),
            micro_batches=int(getattr(trainer, "accumulate_grad_batches", 1) or 1), integration="lightning",
        )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.tracer is not None:
            self.tracer.begin_step(int(trainer.global_step))
            self.tracer.switch_phase("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.tracer is not None:
            self.tracer.switch_phase("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.tracer is not None:
            self.tracer.switch_phase(None)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.tracer is not None:
            self.tracer.switch_phase("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.tracer is not None:
            self.tracer.end_step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.tracer is not None:
            self.tracer.end_step()
            self.tracer.close()
