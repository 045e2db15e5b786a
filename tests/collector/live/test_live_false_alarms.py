"""No straggler (nor data stall, first failure, unheard, silent or stuck) alarm on clean runs: a clean PP2 x DP2 run of 400 steps and one where every rank
enters its gradient reduction 100 ms late (a balanced comm delay: everyone waits, nobody
straggles), 2,000 rank-steps in all, judged live by the built-in rules."""

from __future__ import annotations

import pytest

from tests.collector.live.judged import wait_judged
from tests.collector.live.test_live_runs import _env
from tests.collector.util import sql
from tests.support.services import start_collector
from tests.support.torchrun import torchrun

# alone (tests/conftest.py): the ground truth is that no rank is slower than its peers, so the four
# ranks must share the cores evenly. Beside another multi-process test module on the other worker
# (8+ processes on 2 cores) one rank was descheduled long enough to be flagged 6 steps running (CI,
# stop 42: rank 2 at 72 ms over its peer's 21 ms): it really was that run's slow rank. A CPU burner
# does not do this (`../shared/acceptance/judge-noise`); the rule's tolerance of short bursts is
# tests/collector/live/test_straggler_noise.py.
pytestmark = [pytest.mark.slow, pytest.mark.alone]


def test_no_straggler_alert_over_2000_clean_rank_steps(tmp_path):
    c = start_collector(tmp_path, listen="unix", metrics=True)  # the built-in rules
    try:
        with _env(TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID="clean"):
            r = torchrun(tmp_path / "clean", nproc=4, trace=True, args=["--pp", "2", "--steps", "400"])
        assert r.rc == 0, r.output[-3000:]
        delay = [a for rank in range(4) for a in ("--inject-comm-delay", f"{rank}:100")]
        with _env(TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID="balanced"):
            r = torchrun(tmp_path / "balanced", nproc=4, trace=True, args=["--pp", "2", "--steps", "100", *delay])
        assert r.rc == 0, r.output[-3000:]
        rank_steps = sql(c.addr, "SELECT count(*) FROM step WHERE run_id IN ('clean', 'balanced')").column(0)[0].as_py()
        assert rank_steps == 2000
        # the delay was real: every rank's step grew by about 100 ms (slept outside compute and
        # outside the collectives, on every rank alike: nobody waits longer, nobody straggles)
        grew = sql(c.addr, "SELECT min(b - a) FROM (SELECT rank, median(step_ms) FILTER (WHERE run_id = 'balanced') AS b,"
                           " median(step_ms) FILTER (WHERE run_id = 'clean') AS a FROM step_ranks GROUP BY rank)"
                   ).column(0)[0].as_py()
        assert grew > 50
        wait_judged(c, "clean", "balanced")  # the last steps settle and are judged
        strag = sql(c.addr, "SELECT run_id, rank, first_step, message FROM alerts WHERE signal = 'straggler'").to_pylist()
        assert strag == []
        # nor any other fault judgment: both runs ended with every rank's clean close
        faults = sql(c.addr, "SELECT run_id, signal, rank, message FROM alerts WHERE signal IN ('data_stall', "
                             "'first_failure', 'unheard_rank', 'silent_rank', 'stuck_collective')").to_pylist()
        assert faults == []
        # ...and the engine was judging: another rule fired on the clean run (exposed comm is >30% on
        # gloo CPU runs; the balanced run's delay is a sleep, not comm, so its share depends on the
        # machine's load and is not asserted), and the view names no rank of either run a straggler.
        # The view judges each step alone: a rank descheduled for one step on this shared 2-core
        # machine really was that step's slow rank (CI flagged 2 single steps of the clean run). A
        # straggler is a rank flagged on `for_steps` (6) consecutive steps, what the rule fires on.
        other = sql(c.addr, "SELECT DISTINCT run_id FROM alerts WHERE signal = 'comm_share'").column(0).to_pylist()
        assert "clean" in other
        judged = sql(c.addr, "SELECT run_id, count(*) AS n, count(*) FILTER (WHERE is_straggler) AS flagged FROM stragglers "
                             "WHERE run_id IN ('clean', 'balanced') GROUP BY run_id ORDER BY run_id").to_pylist()
        assert [r["run_id"] for r in judged] == ["balanced", "clean"] and all(r["n"] >= 400 for r in judged)
        held = sql(c.addr, "SELECT run_id, rank, step FROM (SELECT run_id, rank, step, is_straggler AND "
                           "lag(is_straggler) OVER w AND lag(is_straggler, 2) OVER w AND lag(is_straggler, 3) OVER w "
                           "AND lag(is_straggler, 4) OVER w AND lag(is_straggler, 5) OVER w AS held FROM stragglers "
                           "WHERE run_id IN ('clean', 'balanced') WINDOW w AS (PARTITION BY run_id, rank ORDER BY step)) "
                           "WHERE held").to_pylist()
        assert held == [], (held, judged)
    finally:
        c.stop()
