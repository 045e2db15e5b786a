"""A Hugging Face Trainer run for the tests: a tiny GPT-2 built from a config (no hub download),
traced with ``trainer_hooks.integrations.hf.TracetopCallback``; launched by torchrun (DDP on gloo, picked by the
Trainer itself).

    torchrun --standalone --nproc_per_node 2 tests/trainer_hooks/hf_trainer.py --steps 4 --out DIR

Writes ``DIR/rank<k>.json`` with the Trainer's own step count and the model's parameter bytes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from trainer_hooks.integrations.hf import TracetopCallback  # noqa: E402

SEQ = 16


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100, n_positions=SEQ,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    model = build_model()
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 100, (64, SEQ), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(out / "hf"), per_device_train_batch_size=2, max_steps=a.steps,
                                          use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no",
                                          disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[TracetopCallback(heartbeat_s=1)])
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    wrapped = type(trainer.model_wrapped).__name__
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    (out / f"rank{rank}.json").write_text(json.dumps({"global_step": trainer.state.global_step, "wrapped": wrapped,
                                                      "grad_bytes": grad_bytes}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        del trainer
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
