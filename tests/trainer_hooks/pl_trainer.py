"""A Lightning run for the tests (``strategy="ddp"`` on CPU, gloo), traced with
``trainer_hooks.integrations.lightning.TracetopCallback``; launched by torchrun (Lightning uses its processes).

    torchrun --standalone --nproc_per_node 2 tests/trainer_hooks/pl_trainer.py --steps 4 --out DIR [--comm-hook]

Writes ``DIR/rank<k>.json`` with Lightning's own step count and the model's parameter bytes.

``--comm-hook``: the user's DDP comm hook given to Lightning (``DDPStrategy(ddp_comm_hook=...)``,
an fp16-compressing hook that counts its calls). Lightning registers it only when the root device
is CUDA (``DDPStrategy._register_ddp_hooks``); ``UngatedDDPStrategy`` drops that one condition
and registers it as Lightning does on GPU (``_register_ddp_comm_hook``, after the model is wrapped,
before its first forward), so a CPU run takes the path a GPU run takes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch

from trainer_hooks.integrations.lightning import TracetopCallback

HOOK_CALLS: list[int] = []


def counting_fp16_hook(state, bucket):
    """The user's hook: Lightning's documented example (fp16 compression), counting its calls."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    HOOK_CALLS.append(bucket.index())
    return default_hooks.fp16_compress_hook(state, bucket)


class SeeDDP(pl.Callback):
    """What the DDP module Lightning trains holds as its comm hook (read during training: the
    strategy unwraps the model at teardown)."""

    def __init__(self) -> None:
        self.ddp: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.ddp:
            return
        ddp = trainer.strategy.model
        hook = ddp._comm_hooks[0][0] if getattr(ddp, "_comm_hooks", None) else None
        cell = getattr(ddp, "_tracetop_cell", None)
        self.ddp = {"module": type(ddp).__name__, "registered_hook_timed": bool(getattr(hook, "_tracetop_timed", False)),
                    "timed_inner_is_users_hook": cell is not None and cell.inner is counting_fp16_hook}


def ungated_strategy(**kw):
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy

    class UngatedDDPStrategy(DDPStrategy):
        def _register_ddp_hooks(self) -> None:  # DDPStrategy's body without `if self.root_device.type == "cuda"`
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)

    return UngatedDDPStrategy(**kw)


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
    ap.add_argument("--comm-hook", action="store_true", help="DDPStrategy(ddp_comm_hook=...) with the user's hook")
    a = ap.parse_args()
    out = Path(a.out)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, generator=g))
    module = Tiny()
    strategy = ungated_strategy(ddp_comm_hook=counting_fp16_hook) if a.comm_hook else "ddp"
    seen = SeeDDP()
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(out / "pl"), callbacks=[TracetopCallback(heartbeat_s=1), seen])
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=4))
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "global_step": trainer.global_step, "grad_bytes": grad_bytes, "hook_calls": len(HOOK_CALLS), **seen.ddp}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
