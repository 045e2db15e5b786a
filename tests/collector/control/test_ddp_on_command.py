"""A plain PyTorch DDP trainer (3 ranks, gloo) with ``tracer.on_command``: a person's
set-micro-batch reaches every rank's handler at the same step; one that rank 2 refuses is undone
on ranks 0 and 1 at that same boundary (their handler called again with the old value)."""

from __future__ import annotations

import json

import pytest

from tests.collector.control.harness import Client, Trainer, changes, wait_for
from tests.support import ROOT
from tests.support.services import start_collector

pytestmark = pytest.mark.slow
RUN = "loop-ddp-1"
K = 4
#: command boundaries the run goes on for after the refused command is settled
AFTER_B_BOUNDARIES = 8


def _last_step(tmp) -> int:
    """The furthest step any rank has logged (the ranks run in lockstep: none is more than one ahead)."""
    steps = [json.loads(x)["step"] for k in range(3) for x in (tmp / f"rank{k}.jsonl").read_text().splitlines()
             if x.strip().endswith("}") and '"call"' not in x]
    return max(steps, default=0)


def _stop_at(tmp, step: int) -> None:
    (tmp / "stop_at.tmp").write_text(str(step))
    (tmp / "stop_at.tmp").replace(tmp / "stop_at")  # whole, never half-written


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    c = start_collector(tmp, extra_args=["--controller", "off"])
    client = Client(c.addr)
    t = Trainer(tmp, nproc=3, args=["600"], script=str(ROOT / "tests" / "collector" / "control" / "ddp_child.py"),
                env={"TRACETOP_ENDPOINT": c.addr, "TRACETOP_RUN_ID": RUN, "TRACETOP_FLUSH_S": "0.5",
                     "TRACETOP_COMMAND_EVERY_STEPS": str(K), "OUT": str(tmp)})
    out = {}
    try:
        wait_for(lambda: client.sql(f"SELECT count(*) AS n FROM run_start WHERE run_id = '{RUN}'")[0]["n"] == 3,
                 300, "three RUN_START rows", t.output)
        a = client.set_micro_batch(RUN, 2)
        out["A"] = client.wait_action(a.action_id, ("applied", "rejected", "lost", "inconsistent"))
        b = client.set_micro_batch(RUN, 1)
        out["B"] = client.wait_action(b.action_id, ("applied", "rejected", "lost", "inconsistent"))
        # B is settled: the run goes on for AFTER_B_BOUNDARIES more command boundaries (nothing may
        # change in them), then every rank ends at one step instead of running out the 600
        _stop_at(tmp, _last_step(tmp) + AFTER_B_BOUNDARIES * K)
        out["rc"] = t.wait()
        out["steps"] = client.sql(f"SELECT rank, step, micro_batch, micro_batches FROM step WHERE run_id = '{RUN}' "
                                  "ORDER BY rank, step")
        out["log"] = t.output()
        out["ranks"] = {k: [json.loads(x) for x in (tmp / f"rank{k}.jsonl").read_text().splitlines()] for k in range(3)}
    finally:
        t.kill()
        client.close()
        c.stop()
    return out


def test_every_rank_gets_the_command_at_the_same_step(ddp_run):
    assert ddp_run["rc"] == 0, ddp_run["log"][-3000:]
    a = ddp_run["A"]
    assert a["state"] == "applied" and a["ranks_applied"] == 3, a
    for k, rows in ddp_run["ranks"].items():
        calls = [r for r in rows if "call" in r]
        assert calls[0] == {"call": 2, "step": a["step"]}, (k, calls)
        steps = [r for r in rows if "call" not in r]
        assert changes(steps)[0] == (a["step"], (2, 4)), (k, changes(steps))
    stored = {}
    for r in ddp_run["steps"]:
        stored.setdefault(r["rank"], []).append(r)
    assert sorted(stored) == [0, 1, 2]
    for rows in stored.values():
        assert changes(rows) == [(a["step"], (2, 4))]


def test_a_refusal_on_rank_2_is_undone_on_the_others(ddp_run):
    b = ddp_run["B"]
    assert b["state"] == "rejected" and b["ranks_refused"] == 1 and b["ranks_undone"] == 2, b
    assert "rank 2" in b["outcome"] and "will not run micro-batch 1" in b["outcome"]
    for k in (0, 1):
        calls = [r for r in ddp_run["ranks"][k] if "call" in r]
        assert calls[1:] == [{"call": 1, "step": b["step"]}, {"call": 2, "step": b["step"]}], (k, calls)
    for rows in ddp_run["ranks"].values():
        assert all(r["micro_batch"] != 1 for r in rows if "call" not in r)
