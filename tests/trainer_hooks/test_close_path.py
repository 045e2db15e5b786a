"""The tracer's close waits for what it still has to say, and no longer than its deadline: the
command outcomes rank 0 still has to report (trainer_hooks/control_link.py) go out before close
returns when the collector is there, and when it is gone the close ends by the exit path's deadline
(shutdown.py) with the outcome counted as failed, not dropped in silence. A real collector; the
endpoint that is gone is a port nobody listens on. An endpoint never reached costs the close about
a second, however soon after the start it comes (a receiver that refuses, at the network edge)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.services import start_collector
from tracetop.wire.transport import Disconnected
from trainer_hooks import Tracer


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


def _tracer(endpoint: str, run_id: str) -> Tracer:
    return Tracer(endpoint=endpoint, run_id=run_id, rank=0, world_size=1, device="cpu", wrap_collectives=False)


def test_close_reports_the_last_outcome_before_it_returns(tmp_path: Path) -> None:
    c = start_collector(tmp_path)
    try:
        tracer = _tracer(c.addr, "close-reports")
        with tracer.step(0):
            pass
        stats = tracer.commands.stats  # type: ignore[union-attr]
        tracer.commands.link.report("7", False, -1, "refused at rank 0 (the test)")  # type: ignore[union-attr]
        tracer.close()
        # counted when close returned: the report was out, not left to a thread close stopped
        assert (stats["reports_sent"], stats["reports_failed"]) == (1, 0), stats
    finally:
        assert c.stop() == 0


def test_close_within_a_deadline_stops_reporting_to_a_gone_collector_there_and_counts_it() -> None:
    """Before: the close waited out the reporter's five tries (0.5 + 1 + 1.5 + 2 s of backoff, 5 s)
    whatever the deadline, and the report it then gave up on was counted nowhere."""
    tracer = _tracer(_dead_endpoint(), "close-gone")
    with tracer.step(0):
        pass
    stats = tracer.commands.stats  # type: ignore[union-attr]
    link = tracer.commands.link  # type: ignore[union-attr]
    link.report("7", False, -1, "refused at rank 0 (the test)")
    deadline_s = 0.5
    t0 = time.monotonic()
    tracer.close_within(t0 + deadline_s)
    took = time.monotonic() - t0
    # the deadline holds: well under the reporter's 5 s of retries (the rest is the joins' 50 ms
    # floors and the scheduler's latency at load 4)
    assert took < deadline_s + 2.0, f"close_within({deadline_s} s) took {took:.2f} s"
    assert link.reporter is not None
    link.reporter.join(5.0)  # it was told to stop: it ends at its next try or backoff
    assert (stats["reports_sent"], stats["reports_failed"]) == (0, 1), stats
    assert tracer.errors >= 1  # and said, as every hook error


class _RefusedOnRelease:
    """The network edge: a receiver whose every connection is refused, the first refusal held
    until the test releases it (the close then starts before the sender knows it cannot reach)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.tries = 0

    def stream(self, batches: Iterator[Any]) -> Iterator[Any]:
        self.tries += 1
        self.release.wait(60)
        raise Disconnected("connection refused (the test's receiver)")


def test_a_close_before_the_first_refusal_still_gives_up_on_a_never_reached_endpoint() -> None:
    """Before: whether the endpoint was never reached was judged when the close began; a close that
    came before the sender's first try had failed (a short job) waited all of close_timeout_s."""
    edge = _RefusedOnRelease()
    tracer = Tracer(transport=edge, run_id="close-first-try", rank=0, world_size=1, device="cpu",
                    wrap_collectives=False, close_timeout_s=60.0)
    with tracer.step(0):
        pass
    assert tracer.shipper.stats()["last_error"] == ""  # the first try is held: nothing known yet
    closer = threading.Thread(target=tracer.close)
    closer.start()
    while not tracer.closed:
        time.sleep(0.001)
    # the first try fails now: after the close began (and, before, had judged the endpoint: its first
    # milliseconds), before the never-reached rule's second is over
    time.sleep(0.3)
    edge.release.set()
    closer.join(30.0)  # the rule: about a second; before: the full 60 s
    assert not closer.is_alive(), "close waited past the never-reached rule for an endpoint that refuses"
    st = tracer.shipper.stats()
    assert st["last_error"] and not st["connected"] and not st["batches_acked"], st


def test_the_closed_heartbeat_is_the_rank_last_batch(tmp_path: Path) -> None:
    """The heartbeat saying "closed" goes out after every row the rank recorded (a higher seq than
    each data batch): one stream is committed in order, so a collector that stored it had stored them.
    The steps end right before close (nothing drained yet: the close drains them)."""
    import duckdb

    c = start_collector(tmp_path)
    try:
        tracer = Tracer(endpoint=c.addr, run_id="close-last", rank=0, world_size=1, device="cpu",
                        wrap_collectives=False, drain_interval_s=60.0)
        for s in range(3):
            with tracer.step(s):
                pass
        tracer.close()
    finally:
        assert c.stop() == 0
    con = duckdb.connect(str(c.db), read_only=True)
    try:
        closed = con.execute("SELECT count(*) FROM heartbeat WHERE run_id = 'close-last' AND phase = 'closed'").fetchone()
        seqs = dict(con.execute("SELECT kind, max(seq) FROM ingest_log GROUP BY kind").fetchall())
    finally:
        con.close()
    assert closed == (1,)
    data = {k: v for k, v in seqs.items() if k not in ("heartbeat", "gap")}
    assert {"step", "memory"} <= set(data), seqs
    assert seqs["heartbeat"] > max(data.values()), seqs
