"""A rebalance command as the trainer sees it: the samples each data-parallel replica trains per
step, and how a replica turns its share into micro-batches and a loss weight. Pure (no torch).

The collector sends it when a replica is a persistent straggler (collector/control/rebalance.py):
``samples`` has one count per data-parallel replica, summing to the global batch; ``relieved`` is
the replica relieved (-1: back to balanced). A plain DDP loop takes it with

    tracer.on_command("rebalance", apply)       # apply(r: Rebalance); raise to refuse

and, each step, trains ``r.share(replica)`` samples (``r.offset(replica)`` into the step's global
batch, cut with ``r.micro_batch_sizes(replica, M)`` into the same M micro-batches as before) and
scales each micro-batch's loss (its mean over its samples) by ``r.micro_weight(replica, size, M)``,
so the update is the balanced step's: DDP averages the gradients of the dp replicas, and
``sum_i dp x n_i / G x mean_i / dp = sum_i n_i x mean_i / G``, the mean over the global batch. The
undo calls ``apply`` with the split in force before (``current``; the default: the last one
applied, at first the balanced split of the same global batch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rebalance:
    samples: tuple[int, ...]  # per data-parallel replica, in replica order
    relieved: int = -1  # the replica given less; -1: balanced

    @property
    def dp(self) -> int:
        return len(self.samples)

    @property
    def global_batch(self) -> int:
        return sum(self.samples)

    def balanced(self) -> Rebalance:
        """The same global batch in equal shares."""
        return Rebalance((self.global_batch // max(1, self.dp),) * self.dp, -1)

    def share(self, replica: int) -> int:
        return self.samples[replica]

    def offset(self, replica: int) -> int:
        """Where the replica's samples start in the step's global batch."""
        return sum(self.samples[:replica])

    def weight(self, replica: int) -> float:
        """Scale the replica's loss (the mean over its samples) by this: dp x share / global batch
        (1.0 when balanced)."""
        return self.dp * self.samples[replica] / self.global_batch

    def micro_batch_sizes(self, replica: int, micro_batches: int) -> list[int]:
        """The replica's share in ``micro_batches`` micro-batches whose sizes differ by at most one
        (every replica runs as many micro-batches as before: the same collectives on every rank)."""
        n, m = self.samples[replica], max(1, micro_batches)
        return [n // m + (1 if i < n % m else 0) for i in range(m)]

    def micro_weight(self, replica: int, size: int, micro_batches: int) -> float:
        """Scale one micro-batch's mean loss by this when the loop divides each micro-batch's loss by
        the micro-batch count (gradient accumulation): micro_batches x dp x size / global batch."""
        return micro_batches * self.dp * size / self.global_batch
