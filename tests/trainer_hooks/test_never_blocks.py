"""Never blocks: with the collector unreachable the trainer keeps its pace; what did not fit the
hooks' bounded buffer is counted and arrives as gap rows once a collector listens again."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.services import start_collector
from tests.trainer_hooks._harness import query, trainer_env

pytest.importorskip("deepspeed")

STEPS = 500
AWAY_S = 8.0  # the collector starts once the trainer has logged this much training time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logged(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.mark.slow
def test_unreachable_collector_never_slows_training_and_drops_arrive_as_gaps(tmp_path: Path) -> None:
    port = _free_port()
    addr = f"127.0.0.1:{port}"
    log = tmp_path / "steps.jsonl"
    env = trainer_env(addr, "nb1", TRACETOP_BUFFER_BYTES=str(96 * 1024))
    trainer = subprocess.Popen([sys.executable, "-m", "reference_trainer", "--quiet", "--steps", str(STEPS),
                                "--log-jsonl", str(log)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    collector = None
    try:
        deadline = time.monotonic() + 240
        while sum(s["step_time_s"] for s in _logged(log)) < AWAY_S:
            assert trainer.poll() is None, trainer.stdout.read() if trainer.stdout else ""
            assert time.monotonic() < deadline, "the trainer did not reach the step where the collector returns"
            time.sleep(0.05)
        collector = start_collector(tmp_path, listen=addr)
        back_at = len(_logged(log))  # the collector listens from here on (it takes seconds to start)
        away_until = back_at
        out, _ = trainer.communicate(timeout=240)
        assert trainer.returncode == 0, out[-4000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
        if collector is not None:
            assert collector.stop() == 0, collector.text()
    steps = _logged(log)
    assert [s["step"] for s in steps] == list(range(STEPS))
    # pace: steps while nobody listened vs steps once the collector was back (the trainer's own clock)
    away = statistics.median(s["step_time_s"] for s in steps[3:away_until])
    assert back_at < STEPS - 80, "the run ended before the collector was back; raise STEPS"
    back = statistics.median(s["step_time_s"] for s in steps[back_at + 5:])
    # generous: the machine is shared and noisy; blocking on the network would cost seconds
    assert away < 2 * back + 0.05, f"median step {away * 1e3:.1f} ms unreachable vs {back * 1e3:.1f} ms reachable"
    worst = max(s["step_time_s"] for s in steps[3:away_until])
    assert worst < 10 * back + 0.5, f"a step took {worst:.2f} s while the collector was unreachable"

    db = collector.db
    gaps = query(db, "SELECT kind, reason, sum(dropped) FROM gap WHERE run_id = 'nb1' GROUP BY ALL")
    assert gaps and all(reason == "unacked_full" for _, reason, _ in gaps), gaps
    dropped = {kind: n for kind, _, n in gaps}
    stored = {s for (s,) in query(db, "SELECT step FROM step WHERE run_id = 'nb1'")}
    # the tail after the collector returned is complete; every missing STEP row is counted as dropped
    # (a second's margin: the buffered backlog is resent first)
    assert set(range(back_at + 30, STEPS)) <= stored, (back_at, sorted(stored), gaps)
    assert sum(dropped.values()) > 0
    # nothing lost silently: every missing STEP row is counted in a gap row, and nothing stored is
    # counted as dropped (the shipper never drops a batch in flight on a live connection).
    assert len(stored) + dropped.get("step", 0) == STEPS, (len(stored), dropped)
