"""`tracetop demo --headless --steps 60` end to end (the must-show of the post-mortem issue): the
collector judged the run (a straggler alert naming the injected rank, a memory alert), the
controller acted in auto mode, and every rank's STEP rows show the micro-batch change at one step."""

from __future__ import annotations

import subprocess
import sys

import duckdb
import pytest

from tests.support import ROOT

# alone: the ground truth is "rank 3 and no other rank is slow" on 4 processes; beside another
# multi-process job a rank of the demo can be descheduled for the straggler rule's 6 steps and be
# rightly named slow (CI stops 42 and 43 failed on that effect in two other modules)
pytestmark = [pytest.mark.slow, pytest.mark.alone]


def test_demo_headless_judges_and_acts(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "tracetop.cli", "demo", "--headless", "--steps", "60", "--dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "actions (" in r.stdout and "alerts (" in r.stdout
    con = duckdb.connect(str(tmp_path / "demo.duckdb"), read_only=True)
    try:
        (run,) = con.execute("SELECT run_id FROM runs WHERE run_id LIKE 'demo-%'").fetchone()
        stragglers = con.execute("SELECT DISTINCT rank FROM alerts WHERE run_id = ? AND rule = 'straggler'", [run]).fetchall()
        assert stragglers == [(3,)], stragglers  # the injected rank, and no rank that waited for it
        assert con.execute("SELECT count(*) FROM alerts WHERE run_id = ? AND rule = 'memory'", [run]).fetchone()[0] > 0
        # issue 22: the straggler and the memory pressure are one incident each; none before the injection (step 30)
        incidents = con.execute("SELECT rule, rank FROM incidents WHERE run_id = ? ORDER BY first_ns", [run]).fetchall()
        assert sorted(r for r, _ in incidents) == ["memory", "straggler"], incidents
        assert ("straggler", 3) in incidents
        early = con.execute("SELECT count(*) FROM alerts WHERE run_id = ? AND rule = 'straggler' AND fired_step < 30",
                            [run]).fetchone()[0]
        assert early == 0
        assert "as incidents (2)" in r.stdout
        # issue 27: the demo ends with the run's verdict: the injected straggler, and what to do about it
        tail = r.stdout.rstrip().split("\n\n")[-1]
        assert tail.startswith("verdict: straggler") and "rank 3" in tail and "next: " in tail, tail
        acts = con.execute("SELECT kind, value, state, step FROM actions WHERE run_id = ? AND kind = 'micro_batch' "
                           "ORDER BY proposed_ns", [run]).fetchall()
        assert acts and acts[0][2] in ("applied", "verified"), acts
        kind, value, _, step = acts[0]
        # every rank ran the old shape before `step` and the new one from it
        per_rank = con.execute("SELECT rank, min(step) FILTER (WHERE micro_batch = ?) FROM step WHERE run_id = ? "
                               "GROUP BY rank ORDER BY rank", [value, run]).fetchall()
        assert len(per_rank) == 4 and {first for _, first in per_rank} == {step}, per_rank
        before = con.execute("SELECT count(*) FROM step WHERE run_id = ? AND step = ? AND micro_batch <> ?",
                             [run, step - 1, value]).fetchone()[0]
        assert before == 4  # the step before it ran the old shape on every rank
        # issue 25: the agent's GPUs at a replayed step (it ships under its own run id), and the views
        from collector.query import dashboard, snapshot

        cur = con.cursor()  # a cursor of its own: the fetchone() results above are left unfinished
        assert snapshot.build(cur, run, step=30).table("gpus").num_rows == 4  # the demo's 4 fake GPUs
        dashboard.install(cur)
        assert cur.execute("SELECT count(*) FROM hardware_risk WHERE level = 'ok'").fetchall()[0][0] == 4
        assert cur.execute("SELECT count(*) FROM comm_topology WHERE run_id = ?", [run]).fetchall()[0][0] > 0
        cur.close()
        samples = con.execute("SELECT DISTINCT micro_batch * micro_batches FROM step WHERE run_id = ?", [run]).fetchall()
        assert samples == [(8,)]  # the global batch kept
    finally:
        con.close()
