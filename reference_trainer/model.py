"""A GPT-style decoder: token + position embedding, N blocks of attention + MLP, a head.

The model is a flat list of layers so DeepSpeed's ``PipelineModule`` can cut it into stages
(``layer_specs``); the ZeRO shape runs the same layers in one ``nn.Sequential`` (``GPT``).
Attention and MLP are tensor-parallel (``tp_layers``). There is no dropout: a run is a function
of its seed, so layouts and resumed runs can be compared number for number.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from reference_trainer.config import ModelPreset
from reference_trainer.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    init_weight,
    qkv_rows,
)


def layer_seed(seed: int, layer: int, part: int) -> int:
    """The generator seed of one weight: independent of TP, PP and DP."""
    return (seed * 1_000_003 + layer * 101 + part) % (2**63 - 1)


class Embedding(nn.Module):
    """Token + learned position embedding (replicated on every TP rank)."""

    def __init__(self, cfg: ModelPreset, seed: int) -> None:
        super().__init__()
        self.tok = nn.Parameter(init_weight((cfg.vocab, cfg.hidden), layer_seed(seed, 0, 0)))
        self.pos = nn.Parameter(init_weight((cfg.seq_len, cfg.hidden), layer_seed(seed, 0, 1)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(ids, (tuple, list)):
            ids = ids[0]
        return F.embedding(ids, self.tok) + self.pos[: ids.shape[1]]


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x)); q/k/v and MLP-in column-parallel,
    attention-out and MLP-out row-parallel."""

    def __init__(self, cfg: ModelPreset, tp: TPGroup, index: int, seed: int) -> None:
        super().__init__()
        layer = index + 1
        self.n_local_heads = cfg.n_heads // tp.size
        self.head_dim = cfg.head_dim
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, tp, layer_seed(seed, layer, 0),
                                        row_index=qkv_rows(cfg.hidden, cfg.n_heads, tp))
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, tp, layer_seed(seed, layer, 1))
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = ColumnParallelLinear(cfg.hidden, cfg.ffn, tp, layer_seed(seed, layer, 2))
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden, tp, layer_seed(seed, layer, 3))
        # Residual-branch outputs scaled down as in GPT-2, so deep presets start stable.
        with torch.no_grad():
            scale = 1.0 / math.sqrt(2 * cfg.n_layers)
            self.proj.weight.mul_(scale)
            self.fc2.weight.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.ln1(x))  # [b, t, 3 * local_hidden]: q, k, v of this rank's heads
        q, k, v = qkv.split(self.n_local_heads * self.head_dim, dim=-1)

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.n_local_heads, self.head_dim).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the output projection to the vocabulary (replicated on TP ranks)."""

    def __init__(self, cfg: ModelPreset, seed: int) -> None:
        super().__init__()
        last = cfg.n_layers + 1
        self.ln = nn.LayerNorm(cfg.hidden)
        self.weight = nn.Parameter(init_weight((cfg.vocab, cfg.hidden), layer_seed(seed, last, 0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(x), self.weight)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32 whatever the model's dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layer_specs(cfg: ModelPreset, tp: TPGroup, seed: int) -> list:
    """The model as DeepSpeed ``LayerSpec``s: each stage builds only its own layers."""
    from deepspeed.pipe import LayerSpec

    return [
        LayerSpec(Embedding, cfg, seed),
        *[LayerSpec(TransformerBlock, cfg, tp, i, seed) for i in range(cfg.n_layers)],
        LayerSpec(Head, cfg, seed),
    ]


class GPT(nn.Sequential):
    """The whole model in one module (the ZeRO shape: no pipeline)."""

    def __init__(self, cfg: ModelPreset, tp: TPGroup, seed: int) -> None:
        super().__init__(
            Embedding(cfg, seed),
            *[TransformerBlock(cfg, tp, i, seed) for i in range(cfg.n_layers)],
            Head(cfg, seed),
        )
