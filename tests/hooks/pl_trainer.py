"""A Lightning run for the tests (``strategy="ddp"`` on CPU, gloo), traced with
``trainer_hooks.lightning.TracetopCallback``; launched by torchrun (Lightning uses its processes).

    torchrun --standalone --nproc_per_node 2 tests/hooks/pl_trainer.py --steps 4 --out DIR

Writes ``DIR/rank<k>.json`` with Lightning's own step count and the model's parameter bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch

from trainer_hooks.lightning import TracetopCallback


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, generator=g))
    module = Tiny()
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(out / "pl"), callbacks=[TracetopCallback(heartbeat_s=1)])
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=4))
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"global_step": trainer.global_step,
                                                                    "grad_bytes": grad_bytes}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
