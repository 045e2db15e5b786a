"""The controller's two input sources held equal on a real run: the live engine's state
(collector/control/live_inputs.EngineInputs, the default where the engine runs) and the committed
rows (inputs.RowInputs, the fallback where it is off). A real collector in this process (so the
test can reach its engine), the built-in rules, a real 2-rank reference run (PP2 for the bubble,
a declared memory budget, stage 1 slowed for firing alerts) shipping to it over gRPC."""

from __future__ import annotations

import math

import pytest

from collector import app
from collector.control.inputs import RowInputs
from collector.control.live_inputs import EngineInputs
from collector.live.rules import defaults
from tests.collector.control.harness import Trainer, wait_for

pytestmark = pytest.mark.slow
RUN = "loop-inputs-1"
STEPS = 40
WINDOW = 32  # the engine keeps the last 32 steps: 8..39


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inputs")
    h = app.serve(app.CollectorConfig(str(tmp / "c.duckdb"), rules=defaults(), live_window_steps=WINDOW))
    try:
        t = Trainer(tmp, nproc=2, args=["--pp", "2", "--steps", str(STEPS), "--micro-batch", "2", "--micro-batches", "4",
                                        "--memory-budget-mb", "2000", "--activation-mb-per-sample", "8",
                                        "--inject-straggler", "1:150"],
                    env={"TRACETOP_ENDPOINT": h.address, "TRACETOP_RUN_ID": RUN, "TRACETOP_FLUSH_S": "0.5"})
        rc = t.wait()
        assert rc == 0, t.output()[-3000:]
        live, con = h.collector.live, h.collector.con
        # every step in and judged by the engine (its last rows settle within a second or two)
        wait_for(lambda: live.read_state(lambda st: st.runs[RUN].last_evaluated if RUN in st.runs else -1) == STEPS - 1,
                 60, "the engine to judge the last step")
        wait_for(lambda: con.cursor().execute("SELECT count(*) FROM memory WHERE run_id = ? AND step = ?",
                                              [RUN, STEPS - 1]).fetchone()[0] == 2, 30, "the last MEMORY rows")
        rows, eng = RowInputs(con), EngineInputs(live, con)
        out = {"rows": rows.read(), "engine": eng.read(), "windows": {}}
        for first, last in ((30, 38), (9, 20), (0, 5)):  # (0, 5): no longer in the engine's window
            out["windows"][(first, last)] = (rows.samples_per_s(RUN, first, last), eng.samples_per_s(RUN, first, last),
                                             rows.memory_share(RUN, first, last), eng.memory_share(RUN, first, last))
        yield out
    finally:
        h.stop()


def test_the_engine_and_the_rows_give_the_controller_the_same_inputs(both):
    (r,), (e,) = both["rows"], both["engine"]
    assert r.step == e.step == STEPS - 1
    for name in ("run_id", "world_size", "dp", "pp", "zero_stage", "micro_batch", "micro_batches", "offload", "memory"):
        assert getattr(r, name) == getattr(e, name), name
    assert (r.micro_batch, r.micro_batches) == (2, 4)
    assert len(r.memory) == 2 and all(m.budget_bytes == 2000 * 2**20 and m.peak_bytes > 0 for m in r.memory)
    assert len(r.bubble_by_stage) == 2 and r.bubble_by_stage == pytest.approx(e.bubble_by_stage, rel=1e-9)
    assert r.samples_per_s > 0 and r.samples_per_s == pytest.approx(e.samples_per_s, rel=1e-9)
    assert r.optimizer_ms > 0 and r.optimizer_ms == pytest.approx(e.optimizer_ms, rel=1e-9)
    # the rebalance's inputs: per rank compute (median over the window) and the tensor width
    assert r.tp == e.tp == 1 and len(r.compute_ms) == 2 and all(x > 0 for x in r.compute_ms)
    assert r.compute_ms == pytest.approx(e.compute_ms, rel=1e-9)
    assert r.memory_share() == e.memory_share()
    # firing alerts: the `alerts` table (rows) and the engine's book (rank 1, stage 1, is 150 ms slower a step)
    assert {(a.rule, a.signal, a.state) for a in r.alerts} == {(a.rule, a.signal, a.state) for a in e.alerts}
    assert any("stage 1" in a.message for a in e.alerts), e.alerts


def test_verification_windows_agree_and_fall_back_to_the_rows_outside_the_engine(both):
    for (first, last), (rs, es, rm, em) in both["windows"].items():
        assert rs > 0 and es == pytest.approx(rs, rel=1e-9), (first, last, rs, es)
        assert not math.isnan(rm) and em == pytest.approx(rm, rel=1e-9), (first, last, rm, em)
