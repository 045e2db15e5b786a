"""The seed dashboard's views (collector/query/dashboard.py) on real runs.

Topology: a 4-rank gloo loop (tests/collector/topology_loop.py) on two node names, tp=2 x dp=2, the
DP pair (1,3) delayed by rank 3 sleeping DELAY_MS before its all-reduce, into a real collector.
Ground truth from the loop: the TP groups stay in a node, the DP groups cross; the slow pair's
link is node-a → node-b in dp[1,3] (rank 1 waits on it). The collector runs the built-in rules with
the live cross_node_share rule's cadence at 2 s (every_s; 60 s built in): its alerts name the two DP
groups, not the TP ones."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb
import pytest

from collector.live.replay import recompute
from collector.live.rules import DEFAULTS_TOML, parse
from collector.query import dashboard
from tests.collector.live.test_live_runs import _env
from tests.support import ROOT
from tests.support.services import start_collector
from tests.support.torchrun import launch

LOOP = str(ROOT / "tests" / "collector" / "topology_loop.py")
STEPS, DELAY_MS = 16, 60.0


@pytest.fixture(scope="module")
def topo_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("topology")
    rules = tmp / "rules.toml"
    line = "every_s = 60                  # an SQL query over the last window_s of collective rows, this often"
    assert DEFAULTS_TOML.count(line) == 1
    rules.write_text(DEFAULTS_TOML.replace(line, "every_s = 2"))
    c = start_collector(tmp, listen="unix", extra_args=["--rules", str(rules)])
    try:
        with _env(TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID="topo", TRACETOP_FLUSH_S="1"):
            run = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", LOOP,
                          "--steps", str(STEPS), "--delay-ms", str(DELAY_MS)], timeout_s=300)
        assert run.rc == 0, run.output[-3000:]
    finally:
        assert c.stop() == 0, c.text()
    return c.db


@pytest.mark.slow
def test_comm_topology_names_the_cross_node_groups_and_the_slow_pair(topo_file) -> None:
    con = duckdb.connect(str(topo_file), read_only=True)
    try:
        assert "comm_topology" in dashboard.install(con)
        rows = dashboard.rows(con, "SELECT role, \"group\", op, src_node, dst_node, cross_node, calls, latency_ms_p50 "
                               "FROM comm_topology WHERE run_id = 'topo'", [])
        by_group = {}
        for r in rows:
            by_group.setdefault(r["group"], set()).add((r["src_node"], r["dst_node"]))
        # the layout the loop built: TP in a node, DP across the two
        assert by_group == {"tp[0,1]": {("node-a", "node-a")}, "tp[2,3]": {("node-b", "node-b")},
                            "dp[0,2]": {("node-a", "node-b"), ("node-b", "node-a")},
                            "dp[1,3]": {("node-a", "node-b"), ("node-b", "node-a")}}, rows
        for grp in by_group:  # one call a rank a step, its two ranks
            assert sum(r["calls"] for r in rows if r["group"] == grp) == 2 * STEPS, (grp, rows)
        # the judgment: both DP groups are all cross-node (above 0.60); the TP groups are not named
        over = dashboard.cross_node_groups(con, "topo")
        assert sorted(g["group"] for g in over) == ["dp[0,2]", "dp[1,3]"], over
        assert all(g["cross_time_share"] > 0.99 for g in over)
        # the slowest link is the delayed pair's, on the link rank 1 waits on
        top = dashboard.slowest_links(con, "topo", limit=1)[0]
        assert (top["group"], top["op"], top["src_node"], top["dst_node"]) == ("dp[1,3]", "all_reduce", "node-a", "node-b")
        assert top["latency_ms_p50"] >= 0.7 * DELAY_MS, top
        other = [r for r in rows if r["group"] == "dp[0,2]"]
        assert max(r["latency_ms_p50"] for r in other) < 0.5 * top["latency_ms_p50"], (other, top)
    finally:
        con.close()


@pytest.mark.slow
def test_tracetop_query_answers_the_views(topo_file) -> None:
    for view in ("comm_topology", "comm_cross_share", "hardware_risk"):
        r = subprocess.run([sys.executable, "-m", "tracetop.cli", "query", str(topo_file), f"SELECT count(*) AS n FROM {view}",
                            "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        n = json.loads(r.stdout)[0]["n"]  # 2 TP groups x 1 link, 2 DP groups x 2; no agent here
        assert n == (6 if view == "comm_topology" else 4 if view == "comm_cross_share" else 0), (view, n)


@pytest.mark.slow
def test_report_has_the_topology_and_risk_sections(topo_file) -> None:
    from collector.report import build_report

    con = duckdb.connect(str(topo_file), read_only=True)
    try:
        page = build_report(con, "topo")
    finally:
        con.close()
    topo = page.split('<section id="comm-topology">', 1)[1].split("</section>", 1)[0]
    assert "<svg" in topo and "dp[1,3]: 100% of its time cross-node" in topo and "dp[0,2]: 100%" in topo, topo[-2000:]
    assert "tp[0,1]: " not in topo  # in-node groups are not judged
    risk = page.split('<section id="hardware-risk">', 1)[1].split("</section>", 1)[0]
    assert "no GPU samples from an agent" in risk  # this run had no agent


@pytest.mark.slow
def test_live_rule_alerted_the_cross_node_dp_groups_not_the_tp_ones(topo_file) -> None:
    con = duckdb.connect(str(topo_file), read_only=True)
    try:
        rows = dashboard.rows(con, "SELECT * FROM alerts WHERE signal = 'cross_node_share' ORDER BY labels", [])
        others = con.execute("SELECT rule, labels, message FROM alerts WHERE run_id = 'topo' AND "
                             "signal NOT IN ('cross_node_share')").fetchall()
    finally:
        con.close()
    by_group = {json.loads(r["labels"])["group"]: r for r in rows}
    # the DP groups' all-reduces run between node-a and node-b only: 100% cross-node, above 0.60
    assert set(by_group) == {"dp[0,2]", "dp[1,3]"}, rows
    for g, a in by_group.items():
        assert (a["state"], a["kind"], a["severity"], a["run_id"], a["scope"]) == ("firing", "sla", "warning", "topo",
                                                                                   "role"), a
        assert a["value"] == 1.0 and a["threshold"] == 0.60, a
        assert a["message"].startswith(f"group {g} (dp") and "100% of its communication time" in a["message"], a
    # the post-mortem recompute over the same file judges the rule too (as the live engine's last
    # tick at close, over the last window_s): the same two DP groups, at the same share
    con = duckdb.connect(str(topo_file), read_only=True)
    try:
        again = [a for a in recompute(con, parse(DEFAULTS_TOML)) if a.rule == "cross_node_share" and a.state != "pending"]
    finally:
        con.close()
    assert {a.labels["group"]: (a.state, a.value, a.run_id) for a in again} == {
        g: ("firing", 1.0, "topo") for g in by_group}, again
    # a clean run otherwise: no other rule fired on it (no straggler: the delay is in a collective)
    assert not [o for o in others if o[0] in ("hardware_risk", "fragmentation")], others
