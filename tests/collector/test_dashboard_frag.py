"""memory_fragmentation / fragmentation_trend (collector/query/dashboard.py) on real Tracer runs.

A one-rank loop with the real Tracer (its GPU path on a host clock, trainer_hooks.device_clock)
ships to a real collector. The device allocator is the hardware edge: `CachingAllocator` keeps a
caching allocator's books for the loop's real tensors (blocks are cached, split, never coalesced
nor returned). Run `grow`: each step's activation is larger than any cached block, so reserved
grows by it while allocated holds one: fragmentation rises. Run `steady`: the same size every
step reuses the cached block: flat. Ground truth: the allocator's own books."""

from __future__ import annotations

import time

import duckdb
import torch

import trainer_hooks
from collector.live import rules as R
from collector.live.replay import recompute
from collector.query import dashboard, snapshot
from collector.report import build_report
from tests.support.services import start_collector
from trainer_hooks.device_clock import CudaClock, HostDevice
from tui import core

STEPS = 24


class CachingAllocator:
    """(allocated, reserved, peak) bytes of a caching allocator without coalescing."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.allocated = self.reserved = self.peak = 0

    def alloc(self, n: int) -> None:
        fit = min((b for b in self.free if b >= n), default=None)
        if fit is None:
            self.reserved += n
        else:
            self.free.remove(fit)
            if fit > n:
                self.free.append(fit - n)
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def release(self, n: int) -> None:
        self.free.append(n)
        self.allocated -= n

    def stats(self) -> tuple[int, int, int]:
        return self.allocated, self.reserved, self.peak


def _run(addr: str, run_id: str, grow: bool) -> CachingAllocator:
    a = CachingAllocator()
    tracer = trainer_hooks.Tracer(addr, run_id, 0, 1, device_clock=CudaClock(event=HostDevice().event, memory=a.stats),
                                  drain_interval_s=0.02, wrap_collectives=False)
    tracer.describe(model_name="frag-loop")
    prev = None
    for step in range(STEPS):
        with tracer.step(step):
            t = torch.empty((step + 1 if grow else 1) * 65536)  # 256 KiB a unit
            a.alloc(t.nbytes)
            if prev is not None:
                a.release(prev.nbytes)
            prev = t
            time.sleep(0.06)  # a drain (memory sample) or more a step
    tracer.close()
    return a


def test_fragmentation_rises_where_the_allocator_fragments(tmp_path) -> None:
    c = start_collector(tmp_path, listen="unix")
    try:
        books = {"grow": _run(c.addr, "grow", True), "steady": _run(c.addr, "steady", False)}
    finally:
        assert c.stop() == 0, c.text()
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        assert "memory_fragmentation" in dashboard.install(con)
        last = {r: con.execute("SELECT arg_max(frag_share, step), arg_max(measured, step) FROM memory_fragmentation "
                               "WHERE run_id = ?", [r]).fetchone() for r in books}
        trend = {r["run_id"]: r for r in dashboard.rows(con, "SELECT * FROM fragmentation_trend", [])}
        flagged = {r: dashboard.fragmenting_ranks(con, r) for r in books}
        steady_from_1 = con.execute("SELECT min(frag_share), max(frag_share) FROM memory_fragmentation "
                                    "WHERE run_id = 'steady' AND step >= 1").fetchone()
    finally:
        con.close()
    for run, a in books.items():
        alloc, reserved, _ = a.stats()
        assert last[run][1] == "device: reserved - allocated"
        assert abs(last[run][0] - (1 - alloc / reserved)) < 1e-9, (run, last[run], a.stats())  # the last drain's books
    assert trend["grow"]["frag_share_last"] > 0.8 and trend["grow"]["frag_share_per_100_steps"] > 1.0, trend
    # steady: two blocks cached (the next step's activation is made before the last one is freed),
    # one live, from step 1 on: half, flat (step 0 holds one block: 0, where a drain sampled it)
    assert trend["steady"]["frag_share_last"] == 0.5 and steady_from_1 == (0.5, 0.5), (trend, steady_from_1)
    assert [r["rank"] for r in flagged["grow"]] == [0] and flagged["steady"] == [], flagged
    # the live rule (built in) alerted the same: rank 0 of `grow`, nothing on `steady`
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        alerts = dashboard.rows(con, "SELECT * FROM alerts WHERE signal = 'fragmentation'", [])
    finally:
        con.close()
    assert [(a["run_id"], a["rank"], a["state"], a["kind"]) for a in alerts] == [("grow", 0, "firing", "sla")], alerts
    assert alerts[0]["message"].startswith("rank 0's allocator fragmentation") and "per 100 steps" in alerts[0]["message"]
    # and the post-mortem recompute over the same file judges the rule too (as the live engine's
    # last tick at close): rank 0 of `grow`, nothing on `steady`
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        again = [a for a in recompute(con, R.defaults()) if a.rule == "fragmentation" and a.state != "pending"]
    finally:
        con.close()
    assert [(a.run_id, a.labels["rank"], a.state, a.kind) for a in again] == [("grow", "0", "firing", "sla")], again
    assert again[0].message.startswith("rank 0's allocator fragmentation") and "per 100 steps" in again[0].message
    # the GPUs screen's panel and the report read the same view
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        snap = snapshot.build(con, "grow", step=STEPS - 1)
        page = build_report(con, "grow")
    finally:
        con.close()
    measured, shares = core.fragmentation(snap)
    assert measured.startswith("device") and shares[0][-1] == last["grow"][0], (shares, last)
    assert "allocator fragmentation per rank" in page and "fragmentation rising" in page
