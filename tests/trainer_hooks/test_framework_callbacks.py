"""Hugging Face and Lightning callbacks in one process (the dev extra installs both frameworks; the
2-process DDP runs through each are in test_ddp_fsdp.py)."""

from __future__ import annotations

from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport


def test_hf_callback_traces_a_trainer_run(tmp_path) -> None:
    import torch
    import transformers

    from trainer_hooks import Tracer
    from trainer_hooks.integrations.hf import TracetopCallback

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.lin(x).squeeze(-1)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(16)]
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="hf", transport=mem, wrap_collectives=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                                          report_to=[], use_cpu=True, logging_strategy="no", save_strategy="no")
    transformers.Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[TracetopCallback(tracer)]).train()
    steps = mem.rows(Kind.STEP)
    assert list(steps["step"]) == [0, 1, 2]
    assert all(steps["forward_ns"] > 0)


def test_lightning_callback_traces_a_fit(tmp_path) -> None:
    import lightning.pytorch as pl
    import torch

    from trainer_hooks import Tracer
    from trainer_hooks.integrations.lightning import TracetopCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randn(12))
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="pl", transport=mem, wrap_collectives=False)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[TracetopCallback(tracer)])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(ds, batch_size=4))
    steps = mem.rows(Kind.STEP)
    assert list(steps["step"]) == [0, 1, 2]
    assert all(steps["backward_ns"] > 0)
