"""The hooks' GPU path on a machine without a GPU: one process-wide "device" (the shipped test double,
:class:`trainer_hooks.device_clock.HostDevice`) behind every clock a test makes.

An event is done on the "device" ``lag_ns`` (20 ms) after it was recorded (a GPU running behind the
host), or never while ``DEVICE.held`` is set; ``elapsed_time`` raises on an event not done, as CUDA
does. Device syncs are noted in ``DEVICE.syncs`` (the tests require none), every event call with the
name of the thread that made it.
"""

from __future__ import annotations

from trainer_hooks.device_clock import HostClock, HostDevice

DEVICE = HostDevice(lag_ns=20_000_000)


def FakeCudaClock() -> HostClock:  # noqa: N802  (named as the clock type it stands for)
    """The Tracer's own CUDA clock (pool, record, query, elapsed_time) over the shared device."""
    return HostClock(DEVICE)


threads_that = DEVICE.threads_that
