"""An action's life, as plain data and pure transitions; the `actions` table is its record.

    proposed ──approve──▶ approved ──(rank 0 subscribed)──▶ sent ──▶ received (by rank 0)
       │                                       │                        │ every rank reports
       └─reject──▶ dismissed                   └─ not received before   ├──▶ applied ──▶ verified
                                                  it expired: lost      │           └──▶ rolled_back
                                                                        ├──▶ rejected (a rank refused;
                                                                        │     the others undid it)
                                                                        ├──▶ inconsistent (an undo failed)
                                                                        └──▶ incomplete (ranks never reported)

A rollback is an action of its own (``rollback_of`` = the action it undoes); when it is applied,
the action it undoes becomes ``rolled_back``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

KINDS = ("micro_batch", "offload", "rebalance", "profile")
#: the wire's CommandKind numbers
KIND_CODES = {"micro_batch": 1, "offload": 2, "rebalance": 3, "profile": 4}
#: the most values one command carries (trainer_hooks.commands.MAX_VALUES: the second broadcast's cap)
MAX_VALUES = 65536
OPEN = ("proposed", "approved", "sent", "received")
#: CommandStatus.stage -> action_ranks.stage (RESULT splits into applied / refused)
STAGES = {1: "received", 2: "undone", 3: "undo_failed"}
#: how long past its expiry an action not received by rank 0 is marked lost (reports in flight)
LOST_GRACE_NS = 3_000_000_000


@dataclass
class RankReport:
    rank: int
    stage: str  # received | applied | refused | undone | undo_failed
    step: int
    message: str
    micro_batch: int
    micro_batches: int
    reported_ns: int


@dataclass
class Action:
    action_id: str
    run_id: str
    kind: str
    value: int
    previous_value: int | None
    rollback_of: str | None
    state: str
    rule: str
    reason: str
    expected: str
    proposed_by: str
    proposed_ns: int
    ranks_expected: int
    approved_by: str | None = None
    approved_ns: int | None = None
    sent_ns: int | None = None
    expires_ns: int | None = None
    received_ns: int | None = None
    step: int | None = None
    ranks_applied: int = 0
    ranks_refused: int = 0
    ranks_undone: int = 0
    outcome: str = ""
    done_ns: int | None = None
    verification: str | None = None
    verified_ns: int | None = None
    updated_ns: int = 0
    value_list: list[int] | None = None  # the command's list argument (rebalance, profile); None: none
    finals: dict[int, RankReport] = field(default_factory=dict)
    marked_lost: bool = False  # it was marked lost before reports came (not a column)

    COLUMNS = ("action_id", "run_id", "kind", "value", "previous_value", "rollback_of", "state", "rule", "reason",
               "expected", "proposed_by", "proposed_ns", "approved_by", "approved_ns", "sent_ns", "expires_ns",
               "received_ns", "step", "ranks_expected", "ranks_applied", "ranks_refused", "ranks_undone", "outcome",
               "done_ns", "verification", "verified_ns", "updated_ns", "value_list")

    def row(self) -> tuple:
        return tuple(getattr(self, c) for c in self.COLUMNS)

    def shown(self) -> str:
        v = ("on" if self.value else "off") if self.kind == "offload" else str(self.value)
        if self.value_list:
            shown = ",".join(str(x) for x in self.value_list[:16]) + (",…" if len(self.value_list) > 16 else "")
            v += f" [{shown}]"
        return f"{self.kind}={v}"

    def snapshot(self) -> Action:
        return dataclasses.replace(self, finals=dict(self.finals),
                                   value_list=None if self.value_list is None else list(self.value_list))


def report(action: Action, r: RankReport, applied: bool, now_ns: int) -> None:
    """Fold one rank's report into the action (pure but for mutating ``action``)."""
    action.updated_ns = now_ns
    late = action.marked_lost or action.state == "lost"
    if r.stage == "received":
        if action.state in ("approved", "sent"):
            action.state = "received"
            action.received_ns = now_ns
        return
    if r.stage == "refused" and r.step < 0 and r.rank == 0 and not action.finals:
        # rank 0 dropped it before any boundary (expired): no rank has seen it
        action.state, action.done_ns, action.marked_lost = "lost", now_ns, True
        action.outcome = f"rank 0: {r.message}"
        return
    # counted incrementally (a rank's later report replaces its earlier one): summing over every
    # final at each report made a command to 16,384 ranks cost O(n^2), ~10 s of the event loop
    old = action.finals.get(r.rank)
    for x, d in ((old, -1), (r, 1)):
        if x is None:
            continue
        if x.stage == "applied":
            action.ranks_applied += d
        elif x.stage == "refused":
            action.ranks_refused += d
        elif x.stage in ("undone", "undo_failed"):
            action.ranks_undone += d
    action.finals[r.rank] = r
    action.marked_lost = late
    f = action.finals.values()
    action.step = r.step if r.step >= 0 else action.step
    if len(action.finals) < action.ranks_expected:
        if action.state in ("approved", "sent", "lost"):
            action.state = "received"
        action.outcome = f"{len(action.finals)} of {action.ranks_expected} ranks reported"
        return
    action.done_ns = now_ns
    steps = sorted({x.step for x in f})
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps} (ranks disagree)"
    suffix = " (the reports came after it was marked lost)" if late else ""
    if action.ranks_applied == action.ranks_expected and len(steps) == 1:
        action.state = "applied"
        action.outcome = f"{action.shown()} applied on all {action.ranks_expected} ranks at {at}{suffix}"
        return
    failed = [x for x in f if x.stage == "undo_failed"]
    refused = sorted((x for x in f if x.stage == "refused"), key=lambda x: x.rank)
    why = "; ".join(f"rank {x.rank}: {x.message}" for x in refused[:4]) or "no rank refused"
    if failed or len(steps) > 1:
        action.state = "inconsistent"
        bad = "; ".join(f"rank {x.rank}: {x.message}" for x in failed[:4])
        action.outcome = f"{action.shown()} at {at}: refused ({why}); undo failed ({bad}){suffix}"
        return
    action.state = "rejected"
    action.outcome = (f"{action.shown()} not in force on any rank: refused by {len(refused)} rank(s) at {at} ({why}); "
                      f"undone at the same boundary on the {action.ranks_undone} that had applied it{suffix}")
