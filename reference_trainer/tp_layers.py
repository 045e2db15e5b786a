"""Megatron-style tensor-parallel layers, written here (DeepSpeed's AutoTP does not compose with
its pipeline engine; see shared/notes/deepspeed-on-cpu.md).

A column-parallel linear holds a slice of the output features; a row-parallel linear holds a
slice of the input features and all-reduces its output. Between them nothing is communicated.
The two autograd functions are the "f" and "g" of the Megatron paper: ``copy_to_tp`` is the
identity forward and an all-reduce backward, ``reduce_from_tp`` the reverse.

Weights are drawn in full from a generator seeded per layer and then sliced, so a run's numbers
do not depend on TP (or PP): TP2 reproduces TP1's losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class TPGroup:
    """This rank's tensor-parallel coordinates. ``group`` is set once the process groups exist
    (the pipeline module creates them after its layers are specified)."""

    def __init__(self, rank: int, size: int, group: object | None = None) -> None:
        self.rank = rank
        self.size = size
        self.group = group


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=tp.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def init_weight(shape: tuple[int, ...], seed: int, std: float = 0.02) -> torch.Tensor:
    """A full (unsharded) weight drawn from its own generator: the same on every layout."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * std


def _mark(p: nn.Parameter) -> nn.Parameter:
    # DeepSpeed counts a parameter marked model-parallel on every TP rank in the gradient norm.
    p.model_parallel = True  # type: ignore[attr-defined]
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows split across TP ranks; the output stays split.

    ``row_index`` picks which rows of the full weight this rank holds (default: a contiguous
    slice); a fused q/k/v layer passes the rows of its heads."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, seed: int,
                 row_index: torch.Tensor | None = None) -> None:
        super().__init__()
        self.tp = tp
        full = init_weight((out_features, in_features), seed)
        if row_index is None:
            per = out_features // tp.size
            row_index = torch.arange(tp.rank * per, (tp.rank + 1) * per)
        self.weight = nn.Parameter(full[row_index].contiguous())
        self.bias = nn.Parameter(torch.zeros(len(row_index)))
        if tp.size > 1:
            _mark(self.weight)
            _mark(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split across TP ranks; the input arrives split (from a
    column-parallel layer) and the partial products are all-reduced. The bias is replicated."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, seed: int) -> None:
        super().__init__()
        self.tp = tp
        full = init_weight((out_features, in_features), seed)
        per = in_features // tp.size
        self.weight = nn.Parameter(full[:, tp.rank * per:(tp.rank + 1) * per].contiguous())
        self.bias = nn.Parameter(torch.zeros(out_features))
        if tp.size > 1:
            _mark(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y + self.bias


def qkv_rows(hidden: int, n_heads: int, tp: TPGroup) -> torch.Tensor:
    """Rows of a fused [q; k; v] weight (3*hidden x hidden) that hold this rank's heads.

    Slicing the fused weight as one block would give rank 0 all of q and part of k; each rank
    must get q, k and v of the same heads."""
    head_dim = hidden // n_heads
    per = (n_heads // tp.size) * head_dim
    lo = tp.rank * per
    part = torch.arange(lo, lo + per)
    return torch.cat([part, part + hidden, part + 2 * hidden])
