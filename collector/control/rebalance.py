"""Straggler mitigation: move work off a persistently slow data-parallel replica, the global batch
kept (issue 26; Greyhound, ATC'25, does it with micro-batch counts). Pure: no clock, no I/O.

    decide(inputs, in_force, relieved, settings) -> Decision | None   (rebalance, undo, or nothing)
    verify(before_ms, after_ms, loss_before, loss_after, undo, settings) -> Verdict

The command (REBALANCE on the wire): ``values`` = the samples each data-parallel replica trains per
step (dp entries, in replica order, summing to the global batch: dp x micro_batch x micro_batches);
``int_value`` = the replica relieved (-1: back to balanced). Every replica keeps its number of
micro-batches M and cuts its samples into M micro-batches whose sizes differ by at most one, so
every rank runs the same collectives as before (ZeRO 2/3 reduce at every micro-batch: a replica
that ran fewer micro-batches would leave the others waiting in a reduction it never joins). With a
pipeline (pp > 1) every micro-batch of a pipe has one size, so each count is a multiple of M.

Why samples rather than micro-batch counts: 4 replicas of 8 samples (micro-batch 2 x 4), one 50 %
slower per sample. The ideal shares are proportional to speed (1 : 1 : 1 : 2/3), 8.73 x 3 and 5.82
of 32. In samples: 9, 9, 9, 5, the step from 12 sample-times to 9 (75 % of the slowdown back; the
balanced step is 8). In micro-batches of 2 the best is 10, 8, 8, 6: a step of 10 (50 %).

The update stays the balanced step's when each replica scales its loss (the mean over its own
samples) by ``dp x n_i / G``: DDP (and DeepSpeed) average the replicas' gradients, so the mean of
``dp x n_i / G x mean_i`` over the dp replicas is ``sum_i n_i x mean_i / G``, the mean over the
global batch. The trainer side: ``trainer_hooks.rebalance.Rebalance.weight``.

Persistence: a rebalance is proposed only on a *firing* straggler alert (the straggler rule's own
hold, ``for_steps`` consecutive steps, default 6: a blip is not a straggler). It is undone when
the relieved replica's compute per sample is back within ``rebalance_recovered_ratio`` of the
others' median (medians over the controller's window), judged like any change: after the
cooldown, never inside a verification window.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from collector.control.policy import ControlInputs, Decision, Settings, Verdict

RULE = "rebalance"
UNDO_RULE = "rebalance_undo"


def replica_of(rank: int, tp: int, dp: int) -> int:
    """The data-parallel replica of a global rank, in DeepSpeed's pipe x data x model order
    (``PipeModelDataParallelTopology``: rank = (pipe x dp + data) x tp + model); plain DDP: the rank."""
    return (rank // max(1, tp)) % max(1, dp)


def balanced(dp: int, per_replica: int) -> tuple[int, ...]:
    return (per_replica,) * dp


def split(speeds: Sequence[float], total: int, *, granule: int = 1, minimum: int = 1) -> tuple[int, ...]:
    """``total`` samples in shares proportional to ``speeds`` (samples per ms), in whole
    ``granule``s: each share rounded down, then each granule left to the replica that would finish
    it soonest (the slowest replica's time is the step's); then each raised to ``minimum`` (rounded
    up to a granule) with what it takes from the largest shares. () when that cannot be done."""
    n = len(speeds)
    units, least = total // granule, -(-minimum // granule)
    if n == 0 or units < least * n or not all(s > 0 and math.isfinite(s) for s in speeds):
        return ()
    raw = [units * s / sum(speeds) for s in speeds]
    got = [math.floor(x) for x in raw]
    for _ in range(units - sum(got)):
        got[min(range(n), key=lambda i: ((got[i] + 1) / speeds[i], i))] += 1
    for i in range(n):
        while got[i] < least:
            got[max(range(n), key=lambda j: got[j])] -= 1
            got[i] += 1
    return tuple(g * granule for g in got)


def per_sample_ms(inp: ControlInputs, samples: Sequence[int]) -> list[float]:
    """Each replica's compute per sample (ms): its slowest rank's compute (median over the window)
    over the samples it trains; NaN where a rank sent no compute time."""
    worst = [math.nan] * inp.dp
    for rank, ms in enumerate(inp.compute_ms):
        q = replica_of(rank, inp.tp, inp.dp)
        if not math.isnan(ms) and not worst[q] >= ms:
            worst[q] = ms
    return [w / samples[q] if samples[q] > 0 else math.nan for q, w in enumerate(worst)]


def _straggling_replicas(inp: ControlInputs) -> list[tuple[int, int, str]]:
    """(replica, rank, message) of each firing straggler alert."""
    out = []
    for a in inp.alerts:
        if a.state == "firing" and a.signal == "straggler" and "rank" in a.labels:
            rank = int(a.labels["rank"])
            out.append((replica_of(rank, inp.tp, inp.dp), rank, a.message))
    return out


def decide(inp: ControlInputs, in_force: Sequence[int], relieved: int, s: Settings) -> Decision | None:
    """A rebalance (a firing straggler alert, nothing in force), its undo (the relieved replica
    recovered), a hold with the reason, or None (nothing for this policy to say)."""
    dp, per = inp.dp, inp.samples_per_rank
    if dp < 2 or per < 1:
        return None
    total = dp * per
    samples = tuple(in_force) if len(in_force) == dp else balanced(dp, per)
    t = per_sample_ms(inp, samples)
    granule = inp.micro_batches if inp.pp > 1 else 1
    if relieved < 0:
        found = _straggling_replicas(inp)
        if not found:
            return None
        q, rank, _ = found[0]
        if any(math.isnan(x) for x in t):
            return Decision("hold", RULE, f"rank {rank} is a straggler, but not every replica sent its compute "
                            "time: no shares to compute")
        target = split([1.0 / x for x in t], total, granule=granule, minimum=inp.micro_batches)
        if not target or target == samples:
            return Decision("hold", RULE, f"rank {rank} is a straggler, but its slowdown is too small to move a whole "
                            f"{'micro-batch' if granule > 1 else 'sample'} of the {total} per step")
        now_ms = max(n * x for n, x in zip(samples, t))
        then_ms = max(n * x for n, x in zip(target, t))
        others = statistics.median(x for i, x in enumerate(t) if i != q)
        return Decision(
            "act", RULE,
            f"rank {rank} (replica {q}) is a persistent straggler: {t[q]:.2f} ms of compute a sample against "
            f"{others:.2f} ms on the other replicas; samples per replica {list(samples)} -> {list(target)} "
            f"(the global batch stays {total}; each replica's loss weighted by dp x its samples / {total}, "
            "so the update is the balanced step's)",
            "rebalance", q, f"compute-bound step {now_ms:.0f} -> {then_ms:.0f} ms; the loss unchanged",
            RULE, values=target)
    if any(math.isnan(x) for x in t):
        return None
    others = statistics.median(x for i, x in enumerate(t) if i != relieved)
    if t[relieved] <= others * s.rebalance_recovered_ratio:
        return Decision(
            "act", UNDO_RULE,
            f"replica {relieved} recovered: {t[relieved]:.2f} ms of compute a sample against {others:.2f} ms on the "
            f"others (within {s.rebalance_recovered_ratio:.2f}x): back to balanced, {per} samples per replica",
            "rebalance", -1, "the step time stays; every replica trains the same share again", UNDO_RULE,
            values=balanced(dp, per))
    return Decision("hold", RULE, f"rebalance in force: replica {relieved} still computes {t[relieved]:.2f} ms a "
                    f"sample against {others:.2f} ms on the others")


def verify(before_ms: float, after_ms: float, loss_before: float, loss_after: float, *, undo: bool,
           s: Settings) -> Verdict:
    """After ``verify_steps``: a rebalance is kept when the step time fell by at least
    ``rebalance_min_gain`` and the loss curve did not break: no inf where there was a number
    (NaN losses are not counted in the window's median), no rise of the window's median beyond ``rebalance_loss_tolerance`` (default 0.5: a
    median over a few steps moves by 10-20 % with the batches alone; the weights keep the loss
    the balanced step's exactly, so what trips this is a trainer that mishandled the shares). An
    undo is always kept."""
    if not (before_ms > 0) or math.isnan(after_ms):
        return Verdict(True, "kept: no step times to compare")
    change = after_ms / before_ms - 1
    loss = ""
    if math.isfinite(loss_before) and not math.isnan(loss_after):
        loss = f", loss {loss_before:.4f} -> {loss_after:.4f}"
    text = f"step {before_ms:.0f} -> {after_ms:.0f} ms ({change:+.0%}){loss}"
    if undo:
        return Verdict(True, f"verified: {text} (back to balanced)")
    if change > -s.rebalance_min_gain:
        return Verdict(False, f"rolled back: {text}; the step did not fall by {s.rebalance_min_gain:.0%}")
    if loss and loss_after > loss_before * (1 + s.rebalance_loss_tolerance):
        return Verdict(False, f"rolled back: {text}; the loss rose more than {s.rebalance_loss_tolerance:.0%}")
    return Verdict(True, f"verified: {text}")
