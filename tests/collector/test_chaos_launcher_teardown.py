"""`tracetop bench chaos --scenario launcher-teardown` (collector/bench/launcher_teardown.py): the
reference trainer, 4 ranks (PP2 x DP2) under a real torchrun, rank 3 SIGKILLs itself in step 20's
first forward, torchrun SIGTERMs the rest; a real collector and its DuckDB file. Ground truth: the
trainer's own per-rank step logs and the injected kill."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.bench.launcher_teardown import launcher_teardown, table

pytestmark = pytest.mark.slow


def test_launcher_teardown_every_rank_stored_up_to_its_end(tmp_path: Path) -> None:
    # a deadline the test sets generously: the promise is what a flush that completes keeps
    r = launcher_teardown(tmp_path, steps=60, kill_step=20, env={"TRACETOP_EXIT_FLUSH_S": "10"})
    print(table(r))
    assert r["ok"], (r["held"], r["per_rank"], r["torchrun_tail"])
    k = r["per_rank"][3]
    assert k["steps_run"] == 20 and k["missing"] <= k["gap_dropped_steps"], k  # lost, and counted


def test_survivors_flush_at_the_launchers_sigterm_without_handover(tmp_path: Path) -> None:
    """Handover off (TRACETOP_HANDOVER_S=0: every rank ships only every 5 s, as to a remote
    collector): the survivors' steps since their last shipment reach the file only through their
    flush at torchrun's SIGTERM (or at their own exit). The killed rank's loss is then larger (all
    20 steps): counted all the same, by a survivor reading its progress record."""
    r = launcher_teardown(tmp_path, steps=60, kill_step=20, env={"TRACETOP_HANDOVER_S": "0", "TRACETOP_EXIT_FLUSH_S": "10"})
    print(table(r))
    held = r["held"]
    assert held["survivors_stored_or_counted"] and held["killed_loss_marked"] and held["no_duplicates"] \
        and held["killed_loss_counted"], \
        (r["per_rank"], r["torchrun_tail"])
    assert all(r["per_rank"][k]["missing"] == 0 and r["per_rank"][k]["steps_run"] >= 20 for k in (0, 1, 2)), r["per_rank"]
