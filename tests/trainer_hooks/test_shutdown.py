"""The end of a process is part of the path (trainer_hooks/shutdown.py): a plain user DDP loop
under torchrun, one rank SIGKILLed mid-run, torchrun then ends the others with SIGTERM. Real
torchrun, real gloo, a real collector and its DuckDB file; the ground truth is each rank's own log
of the steps it completed (tests/trainer_hooks/user_loop.py) and the kill the test injects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from tests.support import ROOT
from tests.support.services import start_collector
from tests.support.torchrun import launch

pytestmark = pytest.mark.slow

LOOP = str(ROOT / "tests" / "trainer_hooks" / "user_loop.py")


def _completed(log_dir: Path, rank: int) -> list[int]:
    p = log_dir / f"rank{rank}.log"
    return [int(x) for x in p.read_text().split()] if p.exists() else []


def _stored(db: Path, run_id: str, table: str = "step") -> dict[int, list[int]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        out: dict[int, list[int]] = {}
        for rank, step in con.execute(f"SELECT rank, step FROM {table} WHERE run_id = ? ORDER BY rank, step",
                                      [run_id]).fetchall():
            out.setdefault(rank, []).append(step)
        return out
    finally:
        con.close()


def _run_loop(tmp_path: Path, endpoint: str, run_id: str, *, nproc: int, steps: int, kill: str,
              extra_env: dict[str, str], sleep_ms: float = 20.0) -> tuple[int, str, Path]:
    log_dir = tmp_path / "steps"
    env = dict(os.environ, TRACETOP_ENDPOINT=endpoint, TRACETOP_RUN_ID=run_id, PYTHONPATH=str(ROOT), **extra_env)
    env.pop("TRACETOP_DISABLE", None)
    job = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                  LOOP, "--steps", str(steps), "--kill", kill, "--log-dir", str(log_dir),
                  "--sleep-ms", str(sleep_ms)], env=env, timeout_s=300)
    return job.rc, job.output, log_dir


def test_sigterm_from_torchrun_flushes_every_survivor_of_a_plain_ddp_loop(tmp_path: Path) -> None:
    """Handover off (TRACETOP_HANDOVER_S=0) and the default 5 s shipment: every step the survivors
    completed since their last shipment is in the file only if they flushed at torchrun's SIGTERM
    (or at their exit, when gloo failed them first). Before: every rank lost all its steps."""
    c = start_collector(tmp_path, listen="unix")
    try:
        rc, out, log_dir = _run_loop(tmp_path, c.addr, "teardown-plain", nproc=4, steps=200, kill="3@40",
                                     extra_env={"TRACETOP_HANDOVER_S": "0", "TRACETOP_EXIT_FLUSH_S": "10"})
        time.sleep(1.0)
    finally:
        assert c.stop() == 0
    assert rc != 0, out[-2000:]  # the job failed: one rank was killed
    stored = _stored(c.db, "teardown-plain")
    done = {r: _completed(log_dir, r) for r in range(4)}
    assert done[3] == list(range(40)), out[-2000:]  # rank 3 ran steps 0-39, then died in step 40
    for r in range(3):
        assert done[r] and done[r] == list(range(len(done[r]))), out[-2000:]
        missing = sorted(set(done[r]) - set(stored.get(r, [])))
        assert not missing, f"survivor rank {r} lost steps {missing[:5]}…{missing[-5:]} ({len(missing)})\n{out[-3000:]}"
    # what a rank stored is what it ran: no step twice, none it did not complete (a survivor may also
    # store the step its collective failed in, which its own log never reached)
    for r in range(4):
        steps = stored.get(r, [])
        assert len(steps) == len(set(steps))
        assert set(steps) <= set(done[r]) | {len(done[r])}
    # what rank 3 lost is counted: a survivor read its progress record (trainer_hooks/progress.py)
    lost3 = len(set(done[3]) - set(stored.get(3, [])))
    assert lost3 > 0  # handover off: all since its start (its first 5 s shipment never came)
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        counted = con.execute("SELECT coalesce(sum(dropped), 0), max(step) FROM gap WHERE run_id = ? AND rank = 3 "
                              "AND kind = 'step' AND reason LIKE 'died_unacked:steps=%'",
                              ["teardown-plain"]).fetchone()
    finally:
        con.close()
    assert counted[0] >= lost3 and counted[1] == 39, (counted, lost3)  # >=: a batch stored just before the kill, unacked


def test_a_killed_rank_loses_at_most_about_a_step_handing_over_to_a_local_endpoint(tmp_path: Path) -> None:
    """A local endpoint (a unix socket: here the collector's; on a cluster the node agent's): each
    finished step is handed over at its end (at most every TRACETOP_HANDOVER_S), so the rank that is
    SIGKILLed loses at most about a step (before: everything since its last 5 s shipment, here all 40).
    The bound is a step or TRACETOP_HANDOVER_S of steps, whichever is more: the test sets the
    interval below its step time (each forward sleeps 50 ms), so every step is handed over."""
    c = start_collector(tmp_path, listen="unix")
    try:
        rc, out, log_dir = _run_loop(tmp_path, c.addr, "teardown-handover", nproc=2, steps=200, kill="1@40",
                                     extra_env={"TRACETOP_EXIT_FLUSH_S": "10", "TRACETOP_HANDOVER_S": "0.01"},
                                     sleep_ms=50)
        time.sleep(1.0)
    finally:
        assert c.stop() == 0
    done = _completed(log_dir, 1)
    assert done == list(range(40)), out[-2000:]
    stored = _stored(c.db, "teardown-handover").get(1, [])
    assert stored == list(range(len(stored)))  # a prefix: it ships in order
    # the step in which it died never completed; of the 40 it completed at most 2 are missing (the
    # last handover may still have been on its way when the kill came)
    assert len(stored) >= 38, (stored[-5:], out[-2000:])


def test_first_heartbeat_at_start(tmp_path: Path) -> None:
    """A rank's first heartbeat leaves at once, not one heartbeat interval later: the collector
    knows the rank exists before it has run a step (here the interval is 60 s)."""
    c = start_collector(tmp_path, listen="unix")
    code = ("import time, trainer_hooks\n"
            "t = trainer_hooks.Tracer(rank=0, world_size=1, heartbeat_s=60, device='cpu')\n"
            "time.sleep(8)\n"
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, TRACETOP_ENDPOINT=c.addr, TRACETOP_RUN_ID="first-beat", PYTHONPATH=str(ROOT))
    env.pop("TRACETOP_DISABLE", None)
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        time.sleep(1.0)
    finally:
        assert c.stop() == 0
    assert p.returncode == -signal.SIGKILL, p.stderr
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        n = con.execute("SELECT count(*) FROM heartbeat WHERE run_id = 'first-beat'").fetchone()[0]
    finally:
        con.close()
    assert n >= 1, p.stderr


PROBE = str(ROOT / "tests" / "trainer_hooks" / "exit_probe.py")


def _probe(tmp_path: Path, mode: str, addr: str, run_id: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, TRACETOP_ENDPOINT=addr, TRACETOP_RUN_ID=run_id, PYTHONPATH=str(ROOT),
               TRACETOP_HANDOVER_S="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRACETOP_DISABLE", None)
    return subprocess.Popen([sys.executable, PROBE, mode, str(tmp_path / f"{run_id}.steps"), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _until_ready(p: subprocess.Popen) -> list[str]:
    seen = []
    for line in p.stdout:  # type: ignore[union-attr]
        seen.append(line)
        if line.strip() == "ready":
            return seen
    raise AssertionError("".join(seen))


@pytest.mark.parametrize("mode", ["default", "handler", "stuck", "sigint", "sigint-in-del"])
def test_sigterm_flushes_then_ends_the_process_as_it_would_have(tmp_path: Path, mode: str) -> None:
    """SIGTERM to a rank that never calls close(): every step it completed is stored, and the
    process then ends exactly as without the hooks: by SIGTERM (default action), through the
    handler that was there before the Tracer (which exits 7), or, with its main thread stuck in a
    gloo barrier (C++: no Python handler can run), by SIGTERM all the same, long before the
    barrier's 300 s timeout (the watcher thread flushes and takes the default action). SIGINT:
    Python's own handler is the previous one, so KeyboardInterrupt still ends the loop, also when
    the signal lands inside a ``__del__`` the garbage collector runs (where Python drops it)."""
    c = start_collector(tmp_path, listen="unix")
    peer = None
    run_id = f"exit-{mode}"
    try:
        if mode == "stuck":
            store = str(tmp_path / "store")
            peer = _probe(tmp_path, "peer", c.addr, "peer", store)
            p = _probe(tmp_path, mode, c.addr, run_id, store)
        else:
            p = _probe(tmp_path, {"sigint": "default", "sigint-in-del": "garbage"}.get(mode, mode), c.addr, run_id)
        _until_ready(p)
        time.sleep(0.5)  # in the barrier, or a few steps further
        p.send_signal(signal.SIGINT if mode.startswith("sigint") else signal.SIGTERM)
        try:
            rest, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)  # its threads' stacks (exit_probe registers faulthandler)
            time.sleep(2.0)
            p.kill()
            stacks = p.communicate()[0]
            # a KeyboardInterrupt raised where Python ignores exceptions (a __del__, a weakref
            # callback run by the collector) says so on stderr, long before the stacks
            lost = [ln for ln in stacks.splitlines() if "Exception ignored" in ln or "KeyboardInterrupt" in ln]
            raise AssertionError(f"{mode}: the process did not end within 60 s of the signal; what it said of "
                                 f"an exception: {lost[:10]}; where its threads were:\n{stacks[-8000:]}") from None
        time.sleep(0.5)
    finally:
        if peer is not None:
            peer.kill()
            peer.wait()
        assert c.stop() == 0
    if mode == "handler":
        assert p.returncode == 7 and "previous handler" in rest, rest
    elif mode.startswith("sigint"):
        assert p.returncode == -signal.SIGINT and "KeyboardInterrupt" in rest, rest
    else:
        assert p.returncode == -signal.SIGTERM, rest
    done = [int(x) for x in (tmp_path / f"{run_id}.steps").read_text().split()]
    stored = _stored(c.db, run_id).get(0, [])
    assert len(done) >= 20 and sorted(set(done) - set(stored)) == [], (len(done), stored[-3:], rest)
