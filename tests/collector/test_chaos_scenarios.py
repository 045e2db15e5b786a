"""Each chaos scenario in its short form (the long forms are `tracetop bench chaos --scenario S`):
real collector, agent and shipper processes, a real loopback proxy for the partition. Exact
counts: no duplicate, nothing lost without a gap row saying so, every source flushed."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.bench.chaos import chaos


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["freeze", "partition", "agent-kill", "full-spool"])
def test_chaos_scenario_short_form(tmp_path: Path, scenario: str) -> None:
    events = 80_000 if scenario == "full-spool" else 40_000
    r = chaos(2, events, kills=2, kill_every_s=2.0, workdir=tmp_path, scenario=scenario, fault_s=4.0)
    assert r["faults"] >= 1 and r["sent"] == events
    assert r["duplicates"] == 0, r
    assert r["lost_unrecorded"] == 0, r  # every lost row is in a gap row, exactly
    assert r["all_flushed"] and r["collector_exit_code"] == 0, r
    if scenario == "full-spool":
        # the agent's 1 MiB spool and the sources' 1 MiB buffers cannot hold the outage: the agent
        # refuses (the hook keeps the batch), the sources drop their oldest, and say so
        assert r["spool_refusals"] > 0 and r["lost"] > 0 and r["gaps_recorded"] == r["lost"], r
    else:
        assert r["lost"] == 0 and r["gaps_recorded"] == 0, r
    if scenario == "partition":
        assert r["reconnects"] > 0, r
    # agent-kill: the sources ship in Ingest.Push calls of a few ms each, so a kill between two
    # bursts may never fail one (the channel reconnects before the next): no reconnect to require,
    # only that both kills landed while the run was shipping and nothing was lost or doubled
    if scenario == "agent-kill":
        assert r["kills"] == 2, r
    if scenario.startswith("agent"):
        assert r["agent_exit_code"] == 0, r
