"""A wall clock stepped back (NTP, a VM resumed) does not hold a shipper's rows: when a kind is due
is measured on the monotonic clock (tracetop/wire/intake.py); the wall clock only stamps the rows."""

from __future__ import annotations

import time

from tests.wire.test_delivery import _row
from tracetop.events import Kind
from tracetop.wire.shipper import Shipper
from tracetop.wire.transport import MemoryTransport


class SteppedClock:
    """time.time_ns, stepped back an hour once ``step_back()`` is called."""

    def __init__(self) -> None:
        self.offset_ns = 0

    def step_back(self) -> None:
        self.offset_ns = -3_600 * 10**9

    def __call__(self) -> int:
        return time.time_ns() + self.offset_ns


def test_rows_ship_on_time_after_the_wall_clock_steps_back_an_hour():
    mem = MemoryTransport()
    clock = SteppedClock()
    s = Shipper(None, run_id="r", transport=mem, flush_interval_s=0.2, clock_ns=clock)
    try:
        s.record(Kind.COLLECTIVE, *_row(1))  # its first pending row, stamped before the step
        clock.step_back()
        t0 = time.monotonic()
        assert mem.wait_received(1, timeout_s=20.0), "the row waited for the wall clock to catch up"
        took_s = time.monotonic() - t0
        assert took_s < 10.0, f"shipped after {took_s:.1f} s with a 0.2 s interval"
        s.record(Kind.COLLECTIVE, *_row(2))  # and the next, recorded after the step
        assert mem.wait_received(2, timeout_s=20.0)
        assert list(mem.rows(Kind.COLLECTIVE)["step"]) == [1, 2]
    finally:
        s.close(2.0)
