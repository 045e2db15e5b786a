"""The progress record (trainer_hooks/progress.py): a rank that dies by SIGKILL holding steps is
counted once, by a neighbour of the same run; a live rank, another run's loss and a rank with
nothing unacked are not. Real child processes (killed with SIGKILL), a real Shipper on the
in-process MemoryTransport."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT
from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport, Shipper
from trainer_hooks import progress

CHILD = """
import os, signal, sys, time
from trainer_hooks.progress import Progress
from tracetop.events import Kind
p = Progress(sys.argv[1], int(sys.argv[2]), "src-" + sys.argv[2])
for step in range(10, 10 + int(sys.argv[3])):
    p.step_done(step)
p.on_acked(Kind.STEP, int(sys.argv[4]))
print(p.path, flush=True)
if sys.argv[5] == "live":
    time.sleep(60)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _child(run_id: str, rank: int, completed: int, acked: int, live: bool = False) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, run_id, str(rank), str(completed), str(acked),
                          "live" if live else "die"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    p.path = p.stdout.readline().strip()  # type: ignore[attr-defined]
    if not live:
        p.wait(30)
    return p


def _gaps(mem: MemoryTransport) -> list[tuple]:
    g = mem.rows(Kind.GAP)
    return sorted(zip(g["rank"].tolist(), g["step"].tolist(), g["kind"].tolist(), g["dropped"].tolist(),
                      g["reason"].tolist(), g["origin_source"].tolist())) if len(g.get("rank", [])) else []


@pytest.fixture()
def shippers():
    made = []

    def make(run_id: str) -> tuple[Shipper, MemoryTransport]:
        mem = MemoryTransport()
        s = Shipper(None, run_id=run_id, transport=mem, flush_interval_s=0.05)
        made.append(s)
        return s, mem

    yield make
    for s in made:
        s.close(5)


def test_a_killed_rank_is_counted_once_by_a_neighbour_of_its_run(shippers) -> None:
    dead = _child("prog-a", 5, completed=7, acked=3)
    assert dead.returncode < 0
    a, mem_a = shippers("prog-a")
    b, mem_b = shippers("prog-a")
    assert progress.claim_dead(a, "prog-a") == 4
    assert progress.claim_dead(b, "prog-a") == 0  # claimed already: one count
    assert a.flush(10) and b.flush(10)
    # rank 5, its last completed step (10..16), the steps completed and not acked
    assert _gaps(mem_a) == [(5, 16, "step", 4, "died_unacked:steps=13-16", "src-5")]
    assert _gaps(mem_b) == []


def test_live_ranks_other_runs_and_nothing_lost_are_not_counted(shippers) -> None:
    live = _child("prog-b", 1, completed=5, acked=1, live=True)
    other = _child("prog-other", 2, completed=5, acked=1)
    clean = _child("prog-b", 3, completed=4, acked=4)
    try:
        s, mem = shippers("prog-b")
        assert progress.claim_dead(s, "prog-b") == 0
        assert s.flush(10) and _gaps(mem) == []
        from pathlib import Path

        assert Path(live.path).exists() and Path(other.path).exists()  # type: ignore[attr-defined]
        assert not Path(clean.path).exists()  # type: ignore[attr-defined]  # dead with nothing to say: removed
    finally:
        live.kill()
        live.wait()
    s2, mem2 = shippers("prog-other")  # the other run's own neighbour counts it
    assert progress.claim_dead(s2, "prog-other") == 4 and s2.flush(10)
    assert [g[0] for g in _gaps(mem2)] == [2]
    s3, _ = shippers("prog-b")
    progress.claim_dead(s3, "prog-b")  # the live one, now dead: counted, and its file gone
