"""The controller's policies: pure functions from the run's signals to one decision.

    decide(inputs, memory, settings) -> Decision          (which change, if any, and why)
    gate(inputs, memory, settings, now_s) -> str | None    (why no change may be made now)
    verify(before, after, action, settings) -> Verdict     (keep it, or roll it back)

``memory`` (``Memory``) is what the controller has learnt about this run: the micro-batch sizes
that were too big or did not pay, how many changes each problem has had, what is given up on.
It is a frozen record; the policies return a new one. No clock, no I/O: the thin loop around
them (controller.py) reads the inputs, applies the verdicts and keeps the memory.

Policies, in order (the first that wants a change wins):

0. rebalance (rebalance.py): a firing straggler alert (it holds every policy below) -> samples
   moved off the straggler's data-parallel replica, the global batch and the update kept; undone
   when the replica recovers (docs/control.md).

1. memory: the step's peak on some rank above ``memory_high`` (0.90) of its budget -> the next
   smaller micro-batch (more micro-batches, the same samples per step); already at the smallest
   allowed -> optimizer offload on (ZeRO 1/2); nothing left, or ``max_actions_per_problem`` changes
   made and memory still high -> "cannot fix" (once, an alert), and no more memory actions.
2. bubble: a pipeline stage's bubble above the rule's threshold and memory below
   ``memory_headroom`` (0.75) -> the next smaller micro-batch (more micro-batches; the 1F1B bubble
   goes toward (p-1)/(m+p-1)).
3. grow: memory below ``memory_low`` (0.60), no bubble problem, throughput below the best seen ->
   the next larger micro-batch, never one that was too big or did not pay before (no oscillation).
4. offload off: offload on, memory below ``offload_off_below`` (0.50) of budget, and the optimizer
   step ``offload_slowdown`` (20 %) slower than before offload was turned on -> offload off.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from collector.live.model import Alert

HOLD_ALERTS = ("hang", "straggler")


@dataclass(frozen=True)
class RankMemory:
    rank: int
    peak_bytes: int  # the step's peak (trainer_hooks/memory.py)
    budget_bytes: int  # declared; <= 0: none


@dataclass(frozen=True)
class ControlInputs:
    """What the controller sees of one run at its latest complete step (plain data: the live
    engine, or the committed rows (inputs.py), fill it)."""

    run_id: str
    step: int
    world_size: int
    dp: int
    pp: int
    zero_stage: int
    micro_batch: int
    micro_batches: int
    offload: bool
    memory: tuple[RankMemory, ...] = ()
    bubble_by_stage: tuple[float, ...] = ()  # the latest step's bubble rate per stage, 0..1
    bubble_threshold: float = math.nan  # the bubble rule's threshold (rate); NaN: no rule
    samples_per_s: float = math.nan  # the run's, over the last few steps
    optimizer_ms: float = math.nan  # median optimizer step, last few steps
    alerts: tuple[Alert, ...] = ()  # firing now
    tp: int = 1
    compute_ms: tuple[float, ...] = ()  # per rank: forward + backward + optimizer, median over the window (NaN: none)

    @property
    def samples_per_rank(self) -> int:
        return self.micro_batch * self.micro_batches

    def memory_share(self) -> tuple[float, int]:
        """(max over ranks of peak / budget, that rank); (NaN, -1) without budgets."""
        best, who = math.nan, -1
        for m in self.memory:
            if m.budget_bytes > 0 and m.peak_bytes >= 0:
                share = m.peak_bytes / m.budget_bytes
                if not share <= best:  # NaN-safe max
                    best, who = share, m.rank
        return best, who


@dataclass(frozen=True)
class Settings:
    memory_high: float = 0.90
    memory_headroom: float = 0.75
    memory_low: float = 0.60
    offload_off_below: float = 0.50
    offload_slowdown: float = 0.20
    min_micro_batch: int = 1
    max_micro_batch: int = 64
    max_actions_per_problem: int = 2
    cooldown_s: float = 30.0
    cooldown_steps: int = 10
    max_actions_per_hour: int = 6
    verify_steps: int = 10
    max_throughput_drop: float = 0.10
    min_throughput_gain: float = 0.02
    bubble_threshold: float = math.nan  # used when the inputs carry no rule threshold
    # rebalance (rebalance.py): verified when the step falls this much and the loss rises no more
    # than this; undone when the relieved replica's compute a sample is within this of the others'
    rebalance_min_gain: float = 0.05
    rebalance_loss_tolerance: float = 0.50
    rebalance_recovered_ratio: float = 1.15


@dataclass(frozen=True)
class Memory:
    """What the controller learnt about one run."""

    too_big: int = 10**9  # the smallest micro-batch seen above memory_high (never grow to it)
    no_gain: frozenset[int] = frozenset()  # sizes tried larger that did not pay
    changes: tuple[tuple[str, int], ...] = ()  # (problem, count) of changes made per problem
    gave_up: frozenset[str] = frozenset()  # problems reported "cannot fix"
    best_samples_per_s: float = 0.0
    best_micro_batch: int = 0
    optimizer_ms_before_offload: float = math.nan
    unhelped: frozenset[int] = frozenset()  # replicas whose rebalance was rolled back (it did not pay)

    def count(self, problem: str) -> int:
        return dict(self.changes).get(problem, 0)

    def counted(self, problem: str) -> Memory:
        d = dict(self.changes)
        d[problem] = d.get(problem, 0) + 1
        return dataclasses.replace(self, changes=tuple(sorted(d.items())))


@dataclass(frozen=True)
class Decision:
    """``outcome``: ``act`` (propose kind=value), ``hold`` (nothing now), ``cannot_fix`` (give up;
    raise an alert once)."""

    outcome: str
    rule: str = ""
    reason: str = ""
    kind: str = ""
    value: int = 0
    expected: str = ""
    problem: str = ""
    values: tuple[int, ...] = ()  # the command's list argument (rebalance: samples per replica)


@dataclass(frozen=True)
class Verdict:
    keep: bool
    text: str


_GIB = float(2**30)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def smaller(inputs: ControlInputs, s: Settings, mem: Memory) -> int | None:
    """The next smaller micro-batch that divides the samples per rank, within bounds, and not
    one that was rolled back before (it cost throughput: going back to it would oscillate)."""
    c = [d for d in _divisors(inputs.samples_per_rank)
         if s.min_micro_batch <= d < inputs.micro_batch and d not in mem.no_gain]
    return max(c) if c else None


def larger(inputs: ControlInputs, s: Settings, mem: Memory) -> int | None:
    c = [d for d in _divisors(inputs.samples_per_rank)
         if inputs.micro_batch < d <= s.max_micro_batch and d < mem.too_big and d not in mem.no_gain]
    return min(c) if c else None


def _bubble_threshold(inputs: ControlInputs, s: Settings) -> float:
    return inputs.bubble_threshold if not math.isnan(inputs.bubble_threshold) else s.bubble_threshold


def decide(inputs: ControlInputs, mem: Memory, s: Settings) -> tuple[Decision, Memory]:
    share, who = inputs.memory_share()
    mb, mbs = inputs.micro_batch, inputs.micro_batches
    if mb < 1 or mbs < 1:
        return Decision("hold", reason=f"run {inputs.run_id} declared no micro-batch shape"), mem
    peak = next((m for m in inputs.memory if m.rank == who), None)
    # 1. memory
    if share > s.memory_high:
        mem = dataclasses.replace(mem, too_big=min(mem.too_big, mb))
        where = (f"rank {who}'s step peak {peak.peak_bytes / _GIB:.2f} GiB is {share:.0%} of its "  # type: ignore[union-attr]
                 f"{peak.budget_bytes / _GIB:.2f} GiB budget (above {s.memory_high:.0%})")  # type: ignore[union-attr]
        if "memory" in mem.gave_up:
            return Decision("hold", "memory", f"{where}; the controller already gave up on memory"), mem
        if mem.count("memory") >= s.max_actions_per_problem:
            return _give_up(mem, "memory", f"{where} after {mem.count('memory')} changes (the most allowed): "
                            "memory grows whatever the batch shape, as a leak does; the controller cannot fix it, "
                            "look for memory held across steps"), mem_gave(mem, "memory")
        new = smaller(inputs, s, mem)
        if new is not None:
            return Decision("act", "memory", f"{where}: micro-batch {mb} -> {new} with {inputs.samples_per_rank // new} "
                            f"micro-batches keeps {inputs.samples_per_rank} samples per rank per step",
                            "micro_batch", new, f"the step peak falls below {s.memory_high:.0%} of the budget",
                            "memory"), mem
        if inputs.zero_stage in (1, 2) and not inputs.offload:
            return Decision("act", "memory", f"{where}, already at the smallest micro-batch {mb}: optimizer-state "
                            f"offload on (ZeRO {inputs.zero_stage})", "offload", 1,
                            "the optimizer state leaves the device between steps; the peak falls", "memory"), mem
        return _give_up(mem, "memory", f"{where}, at the smallest micro-batch {mb}"
                        + (" with offload on" if inputs.offload else f" and ZeRO {inputs.zero_stage} (no offload)")
                        + ": nothing left to change; the controller cannot fix it"), mem_gave(mem, "memory")
    # 2. bubble
    threshold = _bubble_threshold(inputs, s)
    worst = max(inputs.bubble_by_stage, default=math.nan)
    bubble_problem = inputs.pp > 1 and worst > threshold
    if bubble_problem and not share > s.memory_headroom:
        new = smaller(inputs, s, mem)
        p = inputs.pp
        if new is not None and "bubble" not in mem.gave_up and mem.count("bubble") < s.max_actions_per_problem:
            m2 = inputs.samples_per_rank // new
            return Decision("act", "bubble", f"the pipeline bubble is {worst:.0%} (above {threshold:.0%}) with "
                            f"{mbs} micro-batches over {p} stages; memory has headroom "
                            f"({'no budget' if math.isnan(share) else f'{share:.0%} of budget'}): micro-batch {mb} -> "
                            f"{new}, {m2} micro-batches, same samples per step",
                            "micro_batch", new, f"bubble toward the 1F1B ideal (p-1)/(m+p-1) = {(p - 1) / (m2 + p - 1):.0%} "
                            f"from {(p - 1) / (mbs + p - 1):.0%}", "bubble"), mem
    # 3. grow
    if share < s.memory_low and not bubble_problem and inputs.samples_per_s < mem.best_samples_per_s * (1 - s.min_throughput_gain):
        new = larger(inputs, s, mem)
        if new is not None and "grow" not in mem.gave_up:
            return Decision("act", "grow", f"memory at {share:.0%} of budget (below {s.memory_low:.0%}), no bubble problem, "
                            f"throughput {inputs.samples_per_s:.1f} samples/s below the best seen "
                            f"({mem.best_samples_per_s:.1f} at micro-batch {mem.best_micro_batch}): try micro-batch {new}",
                            "micro_batch", new, f"throughput rises by at least {s.min_throughput_gain:.0%}; rolled back if not",
                            "grow"), mem
    # 4. offload off
    if (inputs.offload and share < s.offload_off_below and not math.isnan(mem.optimizer_ms_before_offload)
            and inputs.optimizer_ms > mem.optimizer_ms_before_offload * (1 + s.offload_slowdown)):
        return Decision("act", "offload_off", f"offload is on, memory is {share:.0%} of budget (below "
                        f"{s.offload_off_below:.0%}) and the optimizer step takes {inputs.optimizer_ms:.1f} ms against "
                        f"{mem.optimizer_ms_before_offload:.1f} ms before offload: offload off", "offload", 0,
                        "the optimizer step gets faster; memory stays below the budget", "offload_off"), mem
    return Decision("hold", reason="nothing to change"), mem


def mem_gave(mem: Memory, problem: str) -> Memory:
    return dataclasses.replace(mem, gave_up=mem.gave_up | {problem})


def _give_up(mem: Memory, problem: str, reason: str) -> Decision:
    return Decision("cannot_fix", problem, reason, problem=problem)


def gate(inputs: ControlInputs, s: Settings, *, now_s: float, last_change_s: float, last_change_step: int,
         changes_last_hour: int, open_action: str = "", unverified: str = "") -> str | None:
    """Why no change may be made now, or None. ``unverified``: an applied change (not a
    rollback) still inside its verification window: one change is judged before the next."""
    firing = [a for a in inputs.alerts if a.state == "firing" and any(h in a.rule or h in a.signal for h in HOLD_ALERTS)]
    if firing:
        return f"no change while alert {firing[0].rule} fires ({firing[0].message})"
    if open_action:
        return f"action {open_action} is still in flight"
    if unverified:
        return f"action {unverified} is applied and not yet verified ({s.verify_steps} steps after it)"
    if now_s - last_change_s < s.cooldown_s or inputs.step - last_change_step < s.cooldown_steps:
        return (f"cooling down after the last change ({now_s - last_change_s:.0f} of {s.cooldown_s:.0f} s, "
                f"{inputs.step - last_change_step} of {s.cooldown_steps} steps)")
    if changes_last_hour >= s.max_actions_per_hour:
        return f"{changes_last_hour} changes in the last hour: the cap ({s.max_actions_per_hour}) is reached"
    return None


def verify(before_samples_per_s: float, after_samples_per_s: float, rule: str, s: Settings,
           memory_before: float = math.nan, memory_after: float = math.nan) -> Verdict:
    """After ``verify_steps``: keep the change, or roll it back (throughput fell more than
    ``max_throughput_drop``; a "grow" that did not gain ``min_throughput_gain``)."""
    if not (before_samples_per_s > 0) or math.isnan(after_samples_per_s):
        return Verdict(True, "kept: no throughput figures to compare")
    change = after_samples_per_s / before_samples_per_s - 1
    moved = ""
    if not math.isnan(memory_before) and not math.isnan(memory_after):
        moved = f"; memory {memory_before:.0%} -> {memory_after:.0%} of budget"
    tput = f"throughput {before_samples_per_s:.1f} -> {after_samples_per_s:.1f} samples/s ({change:+.0%}){moved}"
    if change < -s.max_throughput_drop:
        return Verdict(False, f"rolled back: {tput}, a fall of more than {s.max_throughput_drop:.0%}")
    if rule == "grow" and change < s.min_throughput_gain:
        return Verdict(False, f"rolled back: {tput}, less than the {s.min_throughput_gain:.0%} a larger micro-batch must gain")
    return Verdict(True, f"verified: {tput}")
