"""Is a command one the run can apply? Pure, from the run's shape (its RUN_START rows and the
actions applied since). A refusal says why and what would work; nothing is sent."""

from __future__ import annotations

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

    @property
    def samples_per_rank(self) -> int:
        """Samples each data-parallel rank trains per step: micro-batch x micro-batches."""
        return self.micro_batch * self.micro_batches

    def divisors(self) -> list[int]:
        n = self.samples_per_rank
        return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def refusal(shape: RunShape, kind: str, value: int) -> str | None:
    """None when ``kind``/``value`` can be sent to the run; else the reason, in words."""
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
    return f"unknown command {kind!r}; the commands are micro_batch and offload"


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
