"""The signals as pure functions, on hand-made arrays with hand-computed answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from collector.live import signals as sg


def test_median_of_the_others_matches_brute_force():
    rng = np.random.default_rng(0)
    for n in (2, 3, 4, 5, 8, 33):
        stage = rng.integers(0, 2, n)
        compute = rng.normal(100, 10, n).round(1)  # ties included
        wait = rng.normal(50, 5, n)
        sc = sg.straggler_scores(stage, compute, wait)
        for i in range(n):
            peers = [j for j in range(n) if stage[j] == stage[i] and j != i]
            want = np.median(compute[peers]) if peers else math.nan
            assert sc.others_compute_ms[i] == pytest.approx(want, nan_ok=True)
            assert sc.others_wait_ms[i] == pytest.approx(np.median(wait[peers]) if peers else math.nan, nan_ok=True)


def test_straggler_computes_longest_and_waits_least_victims_are_not():
    # PP2 x DP2: stage 1 = ranks 2, 3. Rank 3 computes 150 ms more; rank 2 waits for it.
    stage = np.array([0, 0, 1, 1])
    compute = np.array([20.0, 21.0, 17.0, 167.0])
    wait = np.array([110.0, 15.0, 150.0, 10.0])
    sc = sg.straggler_scores(stage, compute, wait)
    assert sc.excess_ms[3] == pytest.approx(150) and sc.compute_ratio[3] == pytest.approx(167 / 17)
    flags = sg.stragglers(sc, wait, excess_ms=50, ratio=1.5)
    assert flags.tolist() == [False, False, False, True]
    # the same compute with the waits swapped is not a straggler (it waits most: a victim)
    assert not sg.stragglers(sc, np.array([110.0, 15.0, 10.0, 150.0]), excess_ms=50, ratio=1.5)[3]


def test_balanced_delay_on_every_rank_flags_nobody():
    stage = np.full(8, -1)
    compute = np.full(8, 40.0) + np.arange(8) * 0.5
    wait = np.full(8, 300.0)
    sc = sg.straggler_scores(stage, compute, wait)
    assert not sg.stragglers(sc, wait, excess_ms=50).any()


def test_z_score_needed_with_many_ranks():
    stage = np.zeros(16, int)
    compute = np.full(16, 100.0)
    compute[:8] += np.linspace(-30, 30, 8)  # a spread, so the MAD is not 0
    compute[5] = 170.0
    wait = np.full(16, 50.0)
    wait[5] = 5.0
    sc = sg.straggler_scores(stage, compute, wait)
    med = np.median(compute)
    mad = np.median(np.abs(compute - med))
    assert sc.z_compute[5] == pytest.approx((170 - med) / (1.4826 * mad))
    assert sg.stragglers(sc, wait, excess_ms=50, z=sc.z_compute[5] - 0.1)[5]
    assert not sg.stragglers(sc, wait, excess_ms=50, z=sc.z_compute[5] + 0.1)[5]


def _hb(now, ops, roles, since, steps=(12, 12, 12, 12), beat=None):
    n = len(ops)
    return dict(ranks=np.arange(n), hb_ns=np.array(beat or [now - 1_000_000_000] * n), steps=np.array(steps),
                ops=list(ops), roles=list(roles), since_ns=np.array(since), now_ns=now)


def test_hang_culprit_left_the_program_others_wait():
    now = 100 * 10**9
    usual = [frozenset({("all_reduce", "dp"), ("broadcast", "pp|mp")})] * 4
    hb = _hb(now, ["all_reduce", "all_reduce", "broadcast", "broadcast"], ["dp", "world", "pp|mp", "pp|mp"],
             [now - 20 * 10**9] * 4)
    found = sg.hangs(**hb, usual=usual, silent_s=15, stuck_s=8)
    assert [(h.rank, h.kind, h.op, h.role) for h in found] == [(1, "stuck", "all_reduce", "world")]
    assert found[0].waiting == (0, 2, 3) and found[0].seconds == pytest.approx(20)


def test_silent_rank_makes_the_stuck_ones_waiters():
    now = 100 * 10**9
    usual = [frozenset({("all_reduce", "dp")})] * 3
    hb = _hb(now, ["all_reduce", "", "all_reduce"], ["dp", "", "dp"], [now - 20 * 10**9, -1, now - 20 * 10**9],
             steps=(7, 7, 7), beat=[now - 10**9, now - 30 * 10**9, now - 10**9])
    found = sg.hangs(**hb, usual=usual, silent_s=15, stuck_s=8)
    assert [(h.rank, h.kind, h.waiting) for h in found] == [(1, "silent", (0, 2))]


def test_rank_stuck_while_others_moved_on():
    now = 100 * 10**9
    hb = _hb(now, ["all_gather", "", ""], ["dp", "", ""], [now - 12 * 10**9, -1, -1], steps=(7, 9, 9))
    found = sg.hangs(**hb, usual=[frozenset()] * 3, silent_s=15, stuck_s=8)
    assert [(h.rank, h.kind, h.step) for h in found] == [(0, "stuck", 7)]


def test_bubble_budget_adds_up_and_names_the_waiting():
    stage = np.array([0, 1])
    dur = np.array([100.0, 100.0])
    fb = np.array([30.0, 80.0])
    p2p = np.array([50.0, 2.0])
    p2p_bytes = np.array([1e6, 1e6])  # at the best rate 1e6 bytes/ms: 1 ms of transfer each
    budgets = sg.bubble_budget(stage, dur, fb, p2p, p2p_bytes, 1e6, np.array([10.0, 5.0]), np.array([5.0, 5.0]))
    b0, b1 = budgets
    assert b0.waiting == pytest.approx(0.49) and b0.transfer == pytest.approx(0.01)
    assert b0.compute + b0.waiting + b0.transfer + b0.tail + b0.overhead == pytest.approx(1.0)
    assert b0.bubble == pytest.approx(0.7) and b0.tail == pytest.approx(0.15)
    imb, slow, fast = sg.stage_imbalance(budgets)
    assert (imb, slow, fast) == (pytest.approx(80 / 30), 1, 0)


def test_grad_sync_filter_quantiles_scaling():
    assert sg.is_grad_sync("all_reduce", "dp", 424_448) and not sg.is_grad_sync("all_reduce", "dp", 4)
    assert sg.is_grad_sync("all_gather_into_tensor", "dp", 4096) and not sg.is_grad_sync("all_reduce", "pp|mp", 4096)
    assert sg.is_grad_sync("_reduce_scatter_base", "mp|dp", 4096)
    p50, p99 = sg.quantiles(np.array([10.0, 20.0, 30.0, 40.0]))
    assert p50 == 25 and p99 == pytest.approx(40 - 0.03 * 10)
    assert sg.sqrt_k_ratio(200.0, 4, 50.0, 1, 1.0) == pytest.approx(2.0)   # 200 / (2 * 50)
    assert math.isnan(sg.sqrt_k_ratio(200.0, 2, 50.0, 2, 1.0))            # DP did not grow
    assert sg.sqrt_k_ratio(30.0, 2, 0.0, 1, 20.0) == pytest.approx(30 / (math.sqrt(2) * 20))
    assert sg.per_gpu_tokens_per_s(np.array([1000, 1000]), np.array([500.0, 500.0]), dp=2, world=2) == 2000
    assert sg.within_run_efficiency(np.array([60.0]), np.array([40.0])) == pytest.approx(0.6)


def test_loss_spike_and_memory():
    hist = np.array([2.0] * 15 + [np.nan, 2.0])
    spike, med = sg.loss_spike(hist, 2.4, 16)
    assert med == 2.0 and spike == pytest.approx(0.2)
    assert math.isnan(sg.loss_spike(hist[:10], 2.4, 16)[0])
    frac = sg.memory_used_of_budget(np.array([90.0, 50.0]), np.array([100.0, -1.0]))
    assert frac[0] == pytest.approx(0.9) and math.isnan(frac[1])


def test_no_culprit_while_a_peer_at_the_same_step_is_not_seen_stuck():
    # rank 0 waits in its DP all-reduce; rank 1 (its DP peer) has not reported being stuck yet;
    # ranks 2, 3 (the other stage) went on to step 13: rank 0 is not the culprit
    now = 100 * 10**9
    usual = [frozenset({("all_reduce", "dp")})] * 4
    hb = _hb(now, ["all_reduce", "", "recv", "recv"], ["dp", "", "p2p:pp", "p2p:pp"],
             [now - 12 * 10**9, -1, now - 2 * 10**9, now - 2 * 10**9], steps=(12, 12, 13, 13))
    assert sg.hangs(**hb, usual=usual, silent_s=15, stuck_s=8) == []


def test_a_rank_stalled_in_its_forward_is_the_culprit_its_peers_in_all_reduce_wait():
    # rank 2 beats "forward" at step 12 (no collective) while ranks 0, 1, 3 wait in DDP's all-reduce
    # of step 12 for 20 s: it is stalled in its own work, they are its waiters
    now = 100 * 10**9
    usual = [frozenset({("all_reduce", "dp")})] * 4
    hb = _hb(now, ["all_reduce", "all_reduce", "", "all_reduce"], ["dp", "dp", "", "dp"],
             [now - 20 * 10**9, now - 20 * 10**9, -1, now - 19 * 10**9])
    found = sg.hangs(**hb, usual=usual, silent_s=15, stuck_s=15, phases=["backward", "backward", "forward", "backward"])
    assert [(h.rank, h.kind, h.phase, h.waiting) for h in found] == [(2, "stalled", "forward", (0, 1, 3))]
    assert found[0].seconds == pytest.approx(20)
    # not before they waited stuck_s
    assert sg.hangs(**hb, usual=usual, silent_s=15, stuck_s=25) == []


def test_the_hung_rank_ended_by_its_timeout_before_its_waiters_is_not_stalled():
    # the end of test_live_runs.py's hang run: rank 1 hung in an all-reduce of its own (since 2.3 s),
    # ranks 0, 2, 3 wait in theirs since 2.2-2.3 s; at 37.3 s rank 1's timeout has ended it (its clean
    # close, no collective), theirs not yet. It is not stalled in its own work: it ended. (The replay
    # of the timer rules named it so where a tick fell between its close and theirs; live did not.)
    s = 10**9
    now = int(37.5 * s)
    usual = [frozenset({("all_reduce", "dp")}), frozenset(), frozenset({("all_reduce", "pp|mp")}),
             frozenset({("all_reduce", "pp|mp")})]
    hb = _hb(now, ["all_reduce", "", "all_reduce", "all_reduce"], ["dp", "", "pp|mp", "pp|mp"],
             [int(2.16 * s), -1, int(2.27 * s), int(2.27 * s)], beat=[35 * s, int(37.3 * s), 35 * s, 35 * s])
    first = np.full(4, s // 10)
    closed = ["comm", "closed", "comm", "comm"]
    assert sg.hangs(**hb, usual=usual, silent_s=1e18, stuck_s=8, phases=closed, first_ns=first, beating_s=8) == []
    # its heartbeat between its timeout and its close (in no collective, not closed yet): it was seen
    # stuck in its all-reduce at this step (35 s), it came out of it; it did not stall in its own work
    beating = ["comm", "backward", "comm", "comm"]
    came_out = np.array([False, True, False, False])
    assert sg.hangs(**hb, usual=usual, silent_s=1e18, stuck_s=8, phases=beating, first_ns=first, beating_s=8,
                    was_stuck=came_out) == []
    # a rank beating in its own work, never seen stuck itself: stalled, they its waiters
    for stuck in (None, np.zeros(4, bool)):
        found = sg.hangs(**hb, usual=usual, silent_s=1e18, stuck_s=8, phases=beating, first_ns=first, beating_s=8,
                         was_stuck=stuck)
        assert [(h.rank, h.kind, h.waiting) for h in found] == [(1, "stalled", (0, 2, 3))]
