"""Signals: pure functions over plain arrays (one entry per rank of one step), no I/O.

Each has a named SQL view in collector/ingest/schema.py (_v5) that gives the same numbers over the stored
rows; tests/collector/live hold the two equal. Times are in ms (float64), computed from the same
integer ns columns in both places so that they agree to the last bit.

Definitions (DESIGN §3, issue 10):
- compute: STEP.compute_ns (forward + backward + optimizer self time).
- collective wait: the step's time in non-point-to-point collectives (COLLECTIVE rows whose role
  is not p2p*), waits included: a rank that arrives early at a DP all-reduce waits in it. The p2p
  time of a pipeline is its own budget item (waiting on the neighbour stage), so it is left out:
  a stage-0 rank waiting for a slow stage-1 rank's gradients is a victim, not a fast rank.
- grad-sync: DP-role all_reduce / reduce_scatter / all_gather calls of at least GRAD_MIN_BYTES
  (the 4-byte loss and overflow all-reduces share op and role and are left out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

GRAD_MIN_BYTES = 1024
GRAD_OPS = ("all_reduce", "reduce_scatter", "all_gather")
MAD_SCALE = 1.4826  # MAD -> standard deviation for normal data
Z_MIN_RANKS = 5     # below this many ranks in a stage a z-score says nothing: the ratio decides


def is_grad_sync(op: str, role: str, nbytes: int | np.ndarray) -> bool | np.ndarray:
    return ("dp" in role.split("|")) and op.lstrip("_").startswith(GRAD_OPS) and (nbytes >= GRAD_MIN_BYTES)  # type: ignore[return-value]


# ------------------------------------------------------------------ straggler
@dataclass(frozen=True)
class StragglerScores:
    """Per rank of one step (arrays in the input's order)."""

    stage_ranks: np.ndarray       # ranks in the same stage (including this one)
    others_compute_ms: np.ndarray  # median compute of the stage's other ranks
    others_wait_ms: np.ndarray
    compute_ratio: np.ndarray     # compute / others_compute_ms
    excess_ms: np.ndarray         # compute - others_compute_ms
    z_compute: np.ndarray         # robust z across the stage (NaN when MAD is 0 or one rank)
    z_wait: np.ndarray


def _median_without_self(sorted_vals: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Median of a sorted array with the element at sorted position pos[i] removed, for every i."""
    n = len(sorted_vals)
    m = n - 1
    if m <= 0:
        return np.full(len(pos), np.nan)
    a, b = (m - 1) // 2, m // 2
    ea = sorted_vals[a + (a >= pos)]
    eb = sorted_vals[b + (b >= pos)]
    return (ea + eb) / 2.0


def _median(v: np.ndarray) -> float:
    return float(np.median(v)) if len(v) else math.nan


def _robust_z(v: np.ndarray) -> np.ndarray:
    """(v - median) / (1.4826 MAD); with MAD 0 (most ranks equal) +-inf off the median, 0 on it."""
    if len(v) < 2:
        return np.full(len(v), np.nan)
    med = np.median(v)
    mad = np.median(np.abs(v - med))
    if mad == 0:
        return np.where(v > med, np.inf, np.where(v < med, -np.inf, 0.0))
    return (v - med) / (MAD_SCALE * mad)


def straggler_scores(stage: np.ndarray, compute_ms: np.ndarray, wait_ms: np.ndarray) -> StragglerScores:
    """Robust scores of compute and collective wait within each stage, and the ratio/excess over
    the median of the stage's *other* ranks (what says something when a stage has 2 ranks)."""
    n = len(stage)
    out = {k: np.full(n, np.nan) for k in ("oc", "ow", "zc", "zw")}
    size = np.zeros(n, dtype=np.int64)
    for s in np.unique(stage):
        idx = np.nonzero(stage == s)[0]
        size[idx] = len(idx)
        for vals, key, zkey in ((compute_ms[idx], "oc", "zc"), (wait_ms[idx], "ow", "zw")):
            order = np.argsort(vals, kind="stable")
            pos = np.empty(len(idx), dtype=np.int64)
            pos[order] = np.arange(len(idx))
            out[key][idx] = _median_without_self(vals[order], pos)
            out[zkey][idx] = _robust_z(vals)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = compute_ms / out["oc"]
    return StragglerScores(size, out["oc"], out["ow"], ratio, compute_ms - out["oc"], out["zc"], out["zw"])


def stragglers(sc: StragglerScores, wait_ms: np.ndarray, *, excess_ms: float, ratio: float = 1.5,
               z: float = 3.5) -> np.ndarray:
    """bool per rank: computes longest (excess and ratio over the others' median, and the robust z
    where the stage has Z_MIN_RANKS or more) *and* waits less than the others' median wait."""
    with np.errstate(invalid="ignore"):
        out = (sc.excess_ms > excess_ms) & (sc.compute_ratio > ratio) & (wait_ms < sc.others_wait_ms)
        big = sc.stage_ranks >= Z_MIN_RANKS
        out &= ~big | (sc.z_compute > z)
    return out


# ------------------------------------------------------------------ hangs
@dataclass(frozen=True)
class HangFinding:
    rank: int
    kind: str                 # "silent" | "stuck"
    seconds: float            # silent for / stuck for
    step: int
    op: str = ""
    role: str = ""
    waiting: tuple[int, ...] = ()   # ranks blocked on it (stuck in a collective, not culprits)
    phase: str = ""                 # "stalled": the phase its heartbeats say it is in


def hangs(ranks: np.ndarray, hb_ns: np.ndarray, steps: np.ndarray, ops: list[str], roles: list[str],
          since_ns: np.ndarray, usual: Sequence[frozenset[tuple[str, str]]], now_ns: int, *,
          silent_s: float, stuck_s: float, phases: list[str] | None = None,
          first_ns: np.ndarray | None = None, beating_s: float | None = None,
          was_stuck: np.ndarray | None = None) -> list[HangFinding]:
    """From each rank's latest heartbeat: silent ranks (no heartbeat for silent_s) and ranks stuck
    in one collective for stuck_s. Of the stuck ranks, the culprits are those whose pending
    collective is not one they ran in their last complete step (they left the program every rank
    runs: e.g. an all-reduce on a group nobody else joins); failing that, those the other ranks
    left behind (they moved on to a later step); failing that, with every rank stuck, one alone in
    its (op, role). The other stuck ranks are named as waiting; no one is named while a stuck rank's
    culprit may still be computing (its next heartbeat says). With a silent rank every stuck rank
    waits. With no culprit among them once they waited stuck_s, a rank that beats at their step or
    before in no collective is "stalled" in its own work: the culprit, they its waiters. Stalled
    means alive all along: heard within `beating_s` (default silent_s), and first heard (`first_ns`,
    where given) before the waiters began to wait; a rank that only just started (late, its peers
    blocked for it) is not stalled, nor one that went quiet (dead or frozen: silent_rank's), nor one
    whose latest heartbeat is its clean close (phase "closed", where `phases` are given): it ended,
    nor one seen stuck in a collective itself at its step (`was_stuck[i]`: more than stuck_s there
    by its latest heartbeat in one): it came out of it (a timeout, an error), it did not stall in its
    own work. Both are the hung rank ended by its own timeout a moment before its waiters' timeouts
    end them: a state that lasts as long as their exits differ (seconds under load), judged or not
    by where a tick falls (live: on the collector's deliveries; a replay: on the heartbeats' times).
    `usual[i]`: the (op, role) pairs rank i ran in its last complete step (empty when unknown)."""
    silent_for = (now_ns - hb_ns) / 1e9
    stuck_for = np.where(since_ns > 0, (now_ns - since_ns) / 1e9, 0.0)
    is_silent = silent_for > silent_s
    is_stuck = np.array([bool(o) for o in ops], dtype=bool) & (stuck_for > stuck_s) & ~is_silent
    found: list[HangFinding] = []
    stuck_idx = np.nonzero(is_stuck)[0]
    culprit = np.zeros(len(ranks), dtype=bool)
    stalled_idx: list[int] = []
    if len(stuck_idx):
        free = ~is_stuck & ~is_silent
        # "the others moved on": every rank not stuck is at a later step (one still at the same
        # step may be the culprit, computing: its next heartbeat will say)
        others_min = steps[free].min() if free.any() else -1
        for i in stuck_idx:
            culprit[i] = bool(usual[i]) and (ops[i], roles[i]) not in usual[i]
        if not culprit.any():  # nobody left the program: the ones the others left behind
            for i in stuck_idx:
                culprit[i] = others_min > steps[i]
        if not culprit.any() and not is_silent.any() and not free.any():
            # every rank is stuck and none left the program: one alone in its (op, role) is the odd one
            sigs = [(ops[i], roles[i]) for i in stuck_idx]
            for j, i in enumerate(stuck_idx):
                if sigs.count(sigs[j]) == 1 and len(set(sigs)) > 1 and len(stuck_idx) > 2:
                    culprit[i] = True
        # otherwise a stuck rank whose peers are not (yet) seen stuck or gone is not named while its
        # culprit may be a rank still computing, whose next heartbeat will say; but once they have
        # waited stuck_s, a rank that still beats at their step or before, in no collective, is
        # stalled in its own work (a forward that never ends): it is the culprit, they wait for it
        # (every rank not stuck is such a rank: none moved on past the waiters' step)
        if not culprit.any() and not is_silent.any() and free.any() and steps[free].max() <= steps[stuck_idx].min():
            alive = free & ~np.array([bool(o) for o in ops], dtype=bool)  # in a collective: one more waiter
            alive &= silent_for <= (silent_s if beating_s is None else beating_s)
            if phases is not None:
                alive &= np.array([p != "closed" for p in phases], dtype=bool)
            if was_stuck is not None:
                alive &= ~was_stuck
            if first_ns is not None:
                waited_since = since_ns[stuck_idx].min()
                alive &= (first_ns > 0) & (first_ns <= waited_since)
            stalled_idx = [int(i) for i in np.nonzero(alive)[0]]
    waiting = tuple(int(ranks[i]) for i in stuck_idx if not culprit[i])
    for i in np.nonzero(is_silent)[0]:
        found.append(HangFinding(int(ranks[i]), "silent", float(silent_for[i]), int(steps[i]), waiting=waiting))
    for i in stuck_idx:
        if culprit[i]:
            found.append(HangFinding(int(ranks[i]), "stuck", float(stuck_for[i]), int(steps[i]), ops[i], roles[i],
                                     waiting=waiting))
    waited = float(stuck_for[stuck_idx].max()) if len(stuck_idx) else 0.0
    for i in stalled_idx:
        found.append(HangFinding(int(ranks[i]), "stalled", waited, int(steps[i]),
                                 phase=phases[i] if phases is not None else "", waiting=waiting))
    return found


# ------------------------------------------------------------------ per-step figures
def quantiles(v: np.ndarray) -> tuple[float, float]:
    """(p50, p99) with linear interpolation (DuckDB's quantile_cont)."""
    v = v[~np.isnan(v)]
    if not len(v):
        return math.nan, math.nan
    return float(np.quantile(v, 0.5)), float(np.quantile(v, 0.99))


def comm_share(comm_exposed_ms: np.ndarray, duration_ms: np.ndarray) -> float:
    """Exposed communication / step time, over all ranks of the step."""
    d = float(np.sum(duration_ms))
    return float(np.sum(comm_exposed_ms)) / d if d > 0 else math.nan


@dataclass(frozen=True)
class BubbleBudget:
    """One stage of one step: shares of the stage's summed step time (they add up to 1)."""

    stage: int
    ranks: int
    bubble: float          # 1 - compute share (the existing bubble_by_stage definition)
    compute: float         # forward + backward
    waiting: float         # p2p time beyond the transfer itself: waiting on the neighbour stage
    transfer: float        # p2p bytes at the step's best p2p rate
    tail: float            # ReduceGrads / ReduceTiedGrads and the optimizer
    overhead: float        # the rest: framework, data, Python between instructions
    compute_ms: float      # the stage's median forward + backward per rank


def bubble_budget(stage: np.ndarray, duration_ms: np.ndarray, fwd_bwd_ms: np.ndarray, p2p_ms: np.ndarray,
                  p2p_bytes: np.ndarray, best_p2p_bytes_per_ms: float, reduce_ms: np.ndarray,
                  optimizer_ms: np.ndarray) -> list[BubbleBudget]:
    out = []
    rate = best_p2p_bytes_per_ms if best_p2p_bytes_per_ms > 0 else math.inf
    transfer_ms = np.minimum(p2p_bytes / rate, p2p_ms)
    for s in np.unique(stage):
        i = stage == s
        d = float(duration_ms[i].sum())
        if d <= 0:
            continue
        comp = float(fwd_bwd_ms[i].sum()) / d
        tr = float(transfer_ms[i].sum()) / d
        wait = float(p2p_ms[i].sum()) / d - tr
        tail = float((reduce_ms[i] + optimizer_ms[i]).sum()) / d
        out.append(BubbleBudget(int(s), int(i.sum()), 1 - comp, comp, wait, tr, tail, 1 - comp - wait - tr - tail,
                                float(np.median(fwd_bwd_ms[i]))))
    return out


def stage_imbalance(budgets: list[BubbleBudget]) -> tuple[float, int, int]:
    """(slowest stage's compute / fastest's, slowest stage, fastest stage); NaN with one stage."""
    if len(budgets) < 2:
        return math.nan, -1, -1
    slow = max(budgets, key=lambda b: b.compute_ms)
    fast = min(budgets, key=lambda b: b.compute_ms)
    return (slow.compute_ms / fast.compute_ms if fast.compute_ms > 0 else math.nan), slow.stage, fast.stage


def per_gpu_tokens_per_s(tokens: np.ndarray, duration_ms: np.ndarray, dp: int, world: int) -> float:
    """The run's tokens/s per rank at this step: each rank's replica rate (tokens / step time),
    median over ranks, times the DP replicas, over the world size."""
    ok = (tokens >= 0) & (duration_ms > 0)
    if not ok.any() or world <= 0:
        return math.nan
    rate = tokens[ok] / (duration_ms[ok] / 1e3)
    return float(np.median(rate)) * dp / world


def within_run_efficiency(compute_ms: np.ndarray, comm_exposed_ms: np.ndarray) -> float:
    c, e = float(compute_ms.sum()), float(comm_exposed_ms.sum())
    return c / (c + e) if c + e > 0 else math.nan


def sqrt_k_ratio(grad_sync_p50_ms: float, dp: int, base_p50_ms: float, base_dp: int, floor_ms: float) -> float:
    """grad-sync / (sqrt(k) x the baseline's), k = dp / base_dp; NaN unless DP grew. The baseline's
    figure is at least floor_ms (a DP1 baseline has no gradient reduction to compare with)."""
    if base_dp <= 0 or dp <= base_dp or not grad_sync_p50_ms == grad_sync_p50_ms:
        return math.nan
    base = max(base_p50_ms if base_p50_ms == base_p50_ms else 0.0, floor_ms)
    return grad_sync_p50_ms / (math.sqrt(dp / base_dp) * base) if base > 0 else math.nan


def memory_used_of_budget(used_bytes: np.ndarray, budget_bytes: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(budget_bytes > 0, used_bytes / budget_bytes, np.nan)


def loss_spike(history: np.ndarray, loss: float, window: int) -> tuple[float, float]:
    """((loss - rolling median) / rolling median, the median) over the `window` steps before this
    one; NaN until the window is full or without a loss."""
    h = history[~np.isnan(history)][-window:]
    if len(h) < window or not loss == loss:
        return math.nan, math.nan
    med = float(np.median(h))
    return ((loss - med) / abs(med) if med != 0 else math.nan), med
