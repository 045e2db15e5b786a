"""The node's clock offset to the collector, NTP-style, over Ingest.Clock.

t0 client send, t1 server receive, t2 server send, t3 client receive (all wall-clock ns):
    offset = ((t1 - t0) + (t2 - t3)) / 2     (collector clock minus node clock)
    rtt    = (t3 - t0) - (t2 - t1)
Of a few exchanges the one with the smallest rtt is kept (least queueing, least asymmetry).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

log = logging.getLogger("tracetop.agent.clock")


class ClockSample(NamedTuple):
    offset_ns: int  # collector clock minus node clock
    rtt_ns: int
    at_ns: int  # node wall clock when the exchange finished (t3)


def offset_rtt(t0: int, t1: int, t2: int, t3: int) -> ClockSample:
    return ClockSample(((t1 - t0) + (t2 - t3)) // 2, (t3 - t0) - (t2 - t1), t3)


def best(samples: Sequence[ClockSample]) -> ClockSample | None:
    return min(samples, key=lambda s: s.rtt_ns) if samples else None


def clock_offset_columns(node: str, s: ClockSample) -> dict[str, Any]:
    return {
        "rank": np.array([-1], "<i4"),
        "step": np.array([-1], "<i8"),
        "start_ns": np.array([s.at_ns], "<i8"),
        "duration_ns": np.array([max(0, s.rtt_ns)], "<i8"),
        "node": [node],
        "offset_ns": np.array([s.offset_ns], "<i8"),
        "rtt_ns": np.array([s.rtt_ns], "<i8"),
    }


def measure(
    exchange: Callable[[int], tuple[int, int]], *, n: int = 5, clock_ns: Callable[[], int] = time.time_ns
) -> ClockSample | None:
    """Run `n` exchanges; `exchange(t0)` returns the server's (t1, t2). Failed exchanges are skipped."""
    samples = []
    for _ in range(n):
        t0 = clock_ns()
        try:
            t1, t2 = exchange(t0)
        except Exception as e:  # the collector is down: no sample this round
            log.debug("clock exchange failed: %s", e)
            continue
        samples.append(offset_rtt(t0, t1, t2, clock_ns()))
    return best(samples)


def grpc_exchange(
    endpoint: str, timeout_s: float = 2.0, auth=None
) -> tuple[Callable[[int], tuple[int, int]], Callable[[], None]]:
    """An `exchange` over Ingest.Clock to `endpoint`, and a function closing its channel.
    ``auth``: a tracetop.wire.auth.ClientAuth (TLS, bearer token) for a collector that demands one."""
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc
    from tracetop.wire.auth import ClientAuth

    auth = auth or ClientAuth()
    channel = auth.channel(endpoint)
    stub = pb_grpc.IngestStub(channel)
    metadata = auth.metadata()

    def exchange(t0: int) -> tuple[int, int]:
        r = stub.Clock(pb.ClockRequest(client_send_ns=t0), timeout=timeout_s, metadata=metadata)
        return r.server_recv_ns, r.server_send_ns

    return exchange, channel.close


class ClockProbe:
    """Measures the offset every `interval_s` on a thread of its own; hands each best sample to
    `on_sample`. The first measurement runs at start."""

    def __init__(
        self,
        exchange: Callable[[int], tuple[int, int]],
        on_sample: Callable[[ClockSample], None],
        *,
        interval_s: float = 60.0,
        n: int = 5,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.exchange = exchange
        self.on_sample = on_sample
        self.interval_s = interval_s
        self.n = n
        self.clock_ns = clock_ns
        self.last: ClockSample | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracetop-clock", daemon=True)

    def start(self) -> ClockProbe:
        self._thread.start()
        return self

    def _run(self) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            s = measure(self.exchange, n=self.n, clock_ns=self.clock_ns)
            if s is None:
                wait = min(self.interval_s, 5.0)  # collector away: try again soon
                continue
            self.last = s
            try:
                self.on_sample(s)
            except Exception:
                log.exception("clock sample consumer failed (continuing)")
            wait = self.interval_s

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
