"""Is a command one the run can apply? Pure, from the run's shape (its RUN_START rows and the
actions applied since). A refusal says why and what would work; nothing is sent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunShape:
    """What the collector knows about a run's batch and optimizer, now."""

    run_id: str
    world_size: int
    ranks_started: int
    dp: int
    pp: int
    zero_stage: int
    micro_batch: int  # in force now (after the applied actions)
    micro_batches: int
    offload: bool  # optimizer offload in force now
    rebalance: tuple[int, ...] = ()  # samples per data-parallel replica in force (rebalance); (): balanced
    relieved: int = -1  # the replica the rebalance in force relieves; -1: none

    @property
    def global_batch(self) -> int:
        return self.samples_per_rank * self.dp

    @property
    def samples_per_rank(self) -> int:
        """Samples each data-parallel rank trains per step: micro-batch x micro-batches."""
        return self.micro_batch * self.micro_batches

    def divisors(self) -> list[int]:
        n = self.samples_per_rank
        return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def refusal(shape: RunShape, kind: str, value: int, values: Sequence[int] = ()) -> str | None:
    """None when ``kind``/``value`` (and the list argument ``values``) can be sent to the run;
    else the reason, in words."""
    if kind == "rebalance":
        return _rebalance_refusal(shape, value, list(values))
    if kind == "micro_batch" and shape.rebalance:
        return (f"a rebalance is in force on run {shape.run_id} (samples per replica {list(shape.rebalance)}): a new "
                "micro-batch size would cut those shares differently; undo the rebalance first (rebalance back to "
                "balanced, or roll it back)")
    if kind == "micro_batch":
        if value < 1:
            return f"micro-batch {value}: give a positive number of samples"
        if shape.micro_batch < 1 or shape.micro_batches < 1:
            return (f"run {shape.run_id} declared no micro-batch shape (micro_batch={shape.micro_batch}, "
                    f"micro_batches={shape.micro_batches}); its trainer cannot keep the global batch")
        if shape.samples_per_rank % value:
            return (f"micro-batch {value} does not divide the {shape.samples_per_rank} samples each data-parallel "
                    f"rank trains per step ({shape.micro_batch} x {shape.micro_batches}); the global batch would "
                    f"change. Use one of {shape.divisors()}")
        if value == shape.micro_batch:
            return f"micro-batch {value} is already in force on run {shape.run_id}; nothing to change"
        return None
    if kind == "offload":
        if shape.zero_stage <= 0:
            return (f"run {shape.run_id} runs ZeRO {max(shape.zero_stage, 0)}: there is no ZeRO optimizer whose state "
                    "could move to host memory; offload needs ZeRO 1, 2 or 3")
        if bool(value) == shape.offload:
            return f"optimizer offload is already {'on' if value else 'off'} on run {shape.run_id}; nothing to change"
        return None
    return f"unknown command {kind!r}; the commands are micro_batch, offload and rebalance"


def _rebalance_refusal(shape: RunShape, relieved: int, counts: list[int]) -> str | None:
    """A rebalance: one sample count per data-parallel replica, summing to the global batch, each
    at least the micro-batches every replica runs (multiples of them with a pipeline)."""
    run, dp, m = shape.run_id, shape.dp, shape.micro_batches
    if dp < 2:
        return (f"run {run} has {dp} data-parallel replica: there is no other replica to move work to "
                "(a rebalance needs dp >= 2)")
    if shape.micro_batch < 1 or m < 1:
        return (f"run {run} declared no micro-batch shape (micro_batch={shape.micro_batch}, micro_batches={m}): "
                "the global batch a rebalance must keep is unknown")
    if len(counts) != dp:
        return (f"rebalance gives {len(counts)} sample counts; run {run} has {dp} data-parallel replicas: give one "
                f"count per replica, in replica order, e.g. {[shape.samples_per_rank] * dp} (balanced)")
    if sum(counts) != shape.global_batch:
        return (f"rebalance counts {counts} sum to {sum(counts)}; the global batch of run {run} is {shape.global_batch} "
                f"({dp} replicas x {shape.micro_batch} x {m}): the update would change. Give counts summing to "
                f"{shape.global_batch}")
    few = [i for i, n in enumerate(counts) if n < m]
    if few:
        return (f"rebalance gives replica {few[0]} {counts[few[0]]} samples, fewer than the {m} micro-batches every "
                f"replica runs (each replica keeps its micro-batch count, so every rank runs the same collectives): "
                f"give each at least {m}")
    if shape.pp > 1 and any(n % m for n in counts):
        return (f"rebalance counts {counts} on run {run} with a pipeline (pp={shape.pp}): a pipe runs micro-batches "
                f"of one size, so each count must be a multiple of its {m} micro-batches")
    if not -1 <= relieved < dp:
        return f"rebalance names replica {relieved} as the one relieved: give 0..{dp - 1}, or -1 (back to balanced)"
    in_force = list(shape.rebalance) or [shape.samples_per_rank] * dp
    if counts == in_force:
        return f"samples per replica {counts} are already in force on run {run}; nothing to change"
    return None


#: the most steps one profiling window may take, the most ranks it may name (trainer_hooks/profiling.py)
PROFILE_MAX_STEPS = 100
PROFILE_MAX_RANKS = 16


def profile_refusal(shape: RunShape, steps: int, ranks: list[int] | tuple[int, ...]) -> str | None:
    """None when a profiling window of ``steps`` steps on ``ranks`` can be sent to the run; else why."""
    if steps < 1 or steps > PROFILE_MAX_STEPS:
        return (f"profile --steps {steps}: give 1 to {PROFILE_MAX_STEPS} steps (a window, never always on; "
                "a few steps show what a step does)")
    if not ranks:
        return "profile: name the ranks to profile (--ranks 0,3), or let the run's open incidents name them"
    if len(ranks) > PROFILE_MAX_RANKS:
        return f"profile: {len(ranks)} ranks, at most {PROFILE_MAX_RANKS} in one window; name the ranks to look at"
    bad = sorted({r for r in ranks if not 0 <= r < shape.world_size})
    if bad:
        return (f"profile: no rank {', '.join(map(str, bad))} in run {shape.run_id} (world size {shape.world_size}: "
                f"ranks 0..{shape.world_size - 1})")
    if len(set(ranks)) != len(ranks):
        return f"profile: a rank named twice in {list(ranks)}"
    return None
