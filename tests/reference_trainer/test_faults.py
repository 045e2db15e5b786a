"""Every injected fault has a real effect, measured on the running processes.

Each run switches its faults on at a known step, so the comparison is within one run (before
vs after), with medians and generous tolerances: the machine is shared and noisy."""

from __future__ import annotations

import pytest

from tests.support.torchrun import RunResult, median, torchrun

pytestmark = pytest.mark.slow

DELAY_MS = 300.0


def _ok(r: RunResult) -> RunResult:
    assert r.rc == 0, r.output[-4000:]
    assert not r.leftover_pids
    return r


def _delta(r: RunResult, rank: int, key: str, before: range, after: range) -> float:
    values = r.rank(rank, key)
    return median([values[i] for i in after]) - median([values[i] for i in before])


@pytest.fixture(scope="module")
def dp2_straggler(tmp_path_factory) -> RunResult:
    """DP2 (2 processes): rank 1 straggles by 300 ms from step 7; rank 0 grows 16 MB a step from step 2.
    Medians of 6 and 9 steps: with 4 and 5 a few steps slowed by a loaded machine moved them by 130 ms."""
    tmp = tmp_path_factory.mktemp("straggler")
    return _ok(torchrun(tmp, nproc=2, args=["--steps", "16", "--inject-straggler", f"1:{DELAY_MS:g}@7",
                                            "--inject-mem-growth", "0:16@2"]))


@pytest.fixture(scope="module")
def dp2_comm(tmp_path_factory) -> RunResult:
    """DP2 (2 processes): rank 0 enters its DP gradient reduction 300 ms late from step 4."""
    tmp = tmp_path_factory.mktemp("comm")
    return _ok(torchrun(tmp, nproc=2, args=["--steps", "9", "--inject-comm-delay", f"0:{DELAY_MS:g}@4"]))


@pytest.fixture(scope="module")
def pp2_imbalance(tmp_path_factory) -> RunResult:
    """PP2 (2 processes): stage 1 runs 3x slower from step 6. Big micro-batches, few of them, so
    that compute rather than sleep wake-up latency dominates what is measured."""
    tmp = tmp_path_factory.mktemp("imbalance")
    return _ok(torchrun(tmp, nproc=2, args=["--pp", "2", "--steps", "12", "--micro-batch", "64",
                                            "--micro-batches", "2", "--inject-stage-imbalance", "1:3@6"]))


BEFORE, AFTER = range(1, 7), range(7, 16)


def test_straggler_step_is_ms_longer_and_its_compute_carries_it(dp2_straggler):
    r = dp2_straggler
    step_delta = _delta(r, 0, "step_time_s", BEFORE, AFTER) * 1000
    assert step_delta == pytest.approx(DELAY_MS, rel=0.25)
    # It is rank 1's forward that is longer; rank 0 computes as before and waits in its DP reduction.
    assert _delta(r, 1, "forward_s", BEFORE, AFTER) * 1000 == pytest.approx(DELAY_MS, rel=0.25)
    assert abs(_delta(r, 0, "forward_s", BEFORE, AFTER) * 1000) < 0.25 * DELAY_MS
    assert _delta(r, 0, "dp_reduce_s", BEFORE, AFTER) * 1000 == pytest.approx(DELAY_MS, rel=0.25)
    assert abs(_delta(r, 1, "dp_reduce_s", BEFORE, AFTER) * 1000) < 0.25 * DELAY_MS


def test_mem_growth_rank_holds_mb_more_every_step(dp2_straggler):
    rss = dp2_straggler.rank(0, "rss_bytes")
    per_step_mb = [(rss[i + 1] - rss[i]) / 2**20 for i in range(2, 9)]
    assert median(per_step_mb) == pytest.approx(16, rel=0.25), per_step_mb
    other = dp2_straggler.rank(1, "rss_bytes")
    assert (other[9] - other[2]) / 2**20 < 0.25 * 16 * 7


def test_comm_delay_makes_the_dp_peer_wait_not_compute(dp2_comm):
    r = dp2_comm
    before, after = range(1, 4), range(4, 9)
    # Rank 1 is rank 0's data-parallel peer: it waits the delay inside the reduction.
    assert _delta(r, 1, "dp_reduce_s", before, after) * 1000 == pytest.approx(DELAY_MS, rel=0.25)
    # The late rank's own reduction and everyone's forward are unchanged; the step takes longer.
    assert abs(_delta(r, 0, "dp_reduce_s", before, after) * 1000) < 0.25 * DELAY_MS
    assert abs(_delta(r, 0, "forward_s", before, after) * 1000) < 0.25 * DELAY_MS
    assert _delta(r, 0, "step_time_s", before, after) * 1000 == pytest.approx(DELAY_MS, rel=0.25)


def test_stage_imbalance_makes_that_stage_factor_times_slower(pp2_imbalance):
    r = pp2_imbalance
    before, after = range(1, 6), range(6, 12)

    def compute(rank: int, steps: range) -> float:
        f, b = r.rank(rank, "forward_s"), r.rank(rank, "backward_s")
        return median([f[i] + b[i] for i in steps])

    # Stage 1 (rank 1) sleeps twice its median compute before step 6, in its forward and its
    # backward. On an oversubscribed machine a sleeping process wakes late, which can only add
    # time: the upper bound is loose, the lower one is not (3 x 0.75: its compute after the onset
    # may be 25% faster than before it, as it is on a busy host where the sleeping stage competes
    # less for the CPU).
    ratio = compute(1, after) / compute(1, before)
    assert 3.0 * 0.75 <= ratio <= 3.0 * 1.75, ratio
    assert compute(0, after) / compute(0, before) == pytest.approx(1.0, abs=0.5)  # stage 0 unchanged


def test_hang_blocks_the_others_until_the_timeout_and_all_processes_end(tmp_path):
    timeout_s = 8.0
    r = torchrun(tmp_path, nproc=2, args=["--steps", "6", "--inject-hang", "1@2",
                                          "--dist-timeout-s", f"{timeout_s:g}"])
    assert r.rc != 0
    assert [row["step"] for row in r.rows] == [0, 1]  # rank 0 never finished step 2
    assert "injected hang at step 2" in r.output
    assert "Timed out" in r.output
    # Rank 0 was blocked from the end of step 1 until its collective timed out.
    assert r.exit_unix_s - r.rows[-1]["time_unix_s"] >= 0.8 * timeout_s
    assert r.leftover_pids == []
