"""A synthetic, learnable task generated in-process from a seed (no downloads).

Every sequence is an arithmetic progression modulo the vocabulary, ``x_t = (a + b t) mod V``,
with its own start ``a`` and stride ``b`` (1..MAX_STRIDE). The first token cannot be predicted,
the second only to 1/MAX_STRIDE; after that the sequence is determined by its last two tokens,
so the loss falls from ln V towards ~0 as the model learns to read the stride with attention.

The global batch of a step is a function of (seed, step) only. Each data-parallel rank takes its
contiguous share and cuts it into micro-batches, so the global batch, and the loss averaged over
it, is the same whatever the micro-batch size, TP or PP, or the replicas' shares after a rebalance:
layouts and adjusted runs compare number for number. Both ranks of a TP group (and all stages of a pipeline) compute the same share.
"""

from __future__ import annotations

import torch

MAX_STRIDE = 4


def global_batch(step: int, seed: int, n_samples: int, vocab: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), each int64 [n_samples, seq_len]: labels are inputs shifted by one."""
    g = torch.Generator().manual_seed((seed * 7_919 + step * 104_729 + 17) % (2**63 - 1))
    start = torch.randint(0, vocab, (n_samples, 1), generator=g)
    stride = torch.randint(1, MAX_STRIDE + 1, (n_samples, 1), generator=g)
    t = torch.arange(seq_len + 1).unsqueeze(0)
    seq = (start + stride * t) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def micro_batches_for(step: int, seed: int, *, dp_rank: int, dp: int, micro_batch: int, micro_batches: int,
                      vocab: int, seq_len: int, offset: int | None = None,
                      sizes: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches of ``step``, in order. A rebalance gives the replica ``sizes``
    (its micro-batches) starting at ``offset`` in the same global batch."""
    per_rank = micro_batch * micro_batches
    inputs, labels = global_batch(step, seed, per_rank * dp, vocab, seq_len)
    lo = dp_rank * per_rank if offset is None else offset
    sizes = sizes if sizes is not None else [micro_batch] * micro_batches
    out, at = [], lo
    for n in sizes:
        out.append((inputs[at: at + n], labels[at: at + n]))
        at += n
    return out
