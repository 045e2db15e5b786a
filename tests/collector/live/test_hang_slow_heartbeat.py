"""A hang on a plain DDP loop (tests/collector/live/failure_loop.py, gloo, 4 ranks under torchrun)
whose ranks beat every 10 s (TRACETOP_HEARTBEAT_S, double the default) into a real collector with
the built-in rules (stuck_collective at 15 s): rank 2 enters an all-reduce no other rank joins at
step 10, the others wait in their next collective, the loop's timeout ends the run. Between two
heartbeats the hung rank is unheard for longer than half the stuck threshold: it must be named
stuck once for the hang, not resolved and named again at every heartbeat."""

from __future__ import annotations

import os
import sys

import pytest

from tests.collector.util import sql
from tests.support import ROOT
from tests.support.services import start_collector
from tests.support.torchrun import launch

pytestmark = pytest.mark.slow

LOOP = str(ROOT / "tests" / "collector" / "live" / "failure_loop.py")
HANG_RANK, HANG_STEP, TIMEOUT_S = 2, 10, 60


def test_a_hang_heard_every_10_s_is_named_stuck_once(tmp_path):
    c = start_collector(tmp_path, listen="unix")
    try:
        env = dict(os.environ, TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID="hang10", TRACETOP_HEARTBEAT_S="10")
        job = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", LOOP,
                      "--steps", "30", "--fault", f"hang:{HANG_RANK}:0@{HANG_STEP}", "--timeout-s", str(TIMEOUT_S)],
                     timeout_s=400, env=env)
        assert job.rc != 0, job.output[-2000:]  # the hang ends the run at its timeout
        stuck = sql(c.addr, "SELECT rank, state, first_ns, message FROM alerts WHERE run_id = 'hang10' "
                            "AND signal = 'stuck_collective' ORDER BY first_ns").to_pylist()
    finally:
        c.stop()
    # the hung rank, named once: one alert (a re-fire after a resolve is a new alert row)
    assert [a["rank"] for a in stuck] == [HANG_RANK], stuck
