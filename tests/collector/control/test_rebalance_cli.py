"""`tracetop control ... rebalance N,N,...` against a real collector whose run comes from a real
RUN_START row (an in-process Tracer declaring 4 data-parallel replicas of 8 x 2 samples): a split
that keeps the global batch is stored and shown by `tracetop actions`; one that does not is refused
with the reason (exit 2) and nothing is stored."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.collector.control.harness import Client, wait_for
from tests.support import ROOT
from tests.support.services import start_collector
from trainer_hooks import Tracer

RUN = "rebalance-cli"


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    c = start_collector(tmp_path_factory.mktemp("rebalance-cli"), extra_args=["--controller", "off"])
    t = Tracer(endpoint=c.addr, run_id=RUN, rank=0, world_size=4, wrap_collectives=False)
    t.describe(micro_batch=8, micro_batches=2, zero_stage=2, dp=4)
    t.close()
    client = Client(c.addr)
    wait_for(lambda: client.sql("SELECT count(*) AS n FROM run_start")[0]["n"] == 1, 60, "the run")
    yield c, client
    client.close()
    c.stop()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_a_split_keeping_the_global_batch_is_stored_and_shown(collector):
    c, client = collector
    bad = _cli("control", "--collector", c.addr, "--run", RUN, "rebalance", "18,17,17,10")
    assert bad.returncode == 2 and "sum to 62" in bad.stderr and "global batch" in bad.stderr, bad.stderr
    assert client.sql("SELECT count(*) AS n FROM actions")[0]["n"] == 0
    ok = _cli("control", "--collector", c.addr, "--run", RUN, "rebalance", "18,18,17,11")
    assert ok.returncode == 0 and "approved" in ok.stdout, ok.stderr
    (a,) = client.sql("SELECT kind, value, value_list, previous_value FROM actions")
    assert (a["kind"], a["value"], list(a["value_list"]), a["previous_value"]) == ("rebalance", 3, [18, 18, 17, 11], -1)
    shown = _cli("actions", "--collector", c.addr, "--json")
    assert shown.returncode == 0 and "[18, 18, 17, 11]" in shown.stdout.replace("\n", " "), shown.stdout
