"""Host sampling (psutil): CPU, memory, network and disk throughput -> HOST_SAMPLE columns.

Throughput comes from cumulative counters: `rates` is a pure function of two counter readings and
the monotonic time between them. psutil and both clocks are parameters (real defaults).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

NAN = float("nan")


class HostCounters(NamedTuple):
    """Cumulative counters at one monotonic instant. None = not available on this host."""

    mono_s: float
    net_rx_bytes: float | None
    net_tx_bytes: float | None
    disk_read_bytes: float | None
    disk_write_bytes: float | None


class HostReading(NamedTuple):
    cpu_pct: float | None
    mem_used_bytes: float | None
    mem_total_bytes: float | None
    net_rx_bytes_per_s: float | None
    net_tx_bytes_per_s: float | None
    disk_read_bytes_per_s: float | None
    disk_write_bytes_per_s: float | None


def rates(prev: HostCounters | None, cur: HostCounters) -> tuple[float | None, ...]:
    """Bytes/s for (net rx, net tx, disk read, disk write) between two readings. None where there
    is no previous reading, no counter, no elapsed time, or the counter went backwards (reset)."""
    if prev is None:
        return (None, None, None, None)
    dt = cur.mono_s - prev.mono_s
    out: list[float | None] = []
    for a, b in zip(prev[1:], cur[1:]):
        if a is None or b is None or dt <= 0 or b < a:
            out.append(None)
        else:
            out.append((b - a) / dt)
    return tuple(out)


def host_sample_columns(node: str, now_ns: int, r: HostReading) -> dict[str, Any]:
    """HOST_SAMPLE columns (one row)."""
    cols: dict[str, Any] = {
        "rank": np.array([-1], dtype="<i4"),
        "step": np.array([-1], dtype="<i8"),
        "start_ns": np.array([now_ns], dtype="<i8"),
        "duration_ns": np.zeros(1, dtype="<i8"),
        "node": [node],
    }
    for name, v in zip(HostReading._fields, r):
        cols[name] = np.array([NAN if v is None else v], dtype="<f8")
    return cols


class HostSampler:
    def __init__(
        self,
        node: str,
        *,
        psutil_mod: Any = None,
        clock_ns: Callable[[], int] = time.time_ns,
        mono_s: Callable[[], float] = time.monotonic,
    ) -> None:
        if psutil_mod is None:
            import psutil as psutil_mod
        self.ps = psutil_mod
        self.node = node
        self.clock_ns = clock_ns
        self.mono_s = mono_s
        self.ps.cpu_percent(interval=None)  # primes the CPU counter: the next call covers the interval
        self._prev: HostCounters | None = self.counters()

    def counters(self) -> HostCounters:
        net = self.ps.net_io_counters()
        disk = self.ps.disk_io_counters()  # None in some containers
        return HostCounters(
            self.mono_s(),
            None if net is None else float(net.bytes_recv),
            None if net is None else float(net.bytes_sent),
            None if disk is None else float(disk.read_bytes),
            None if disk is None else float(disk.write_bytes),
        )

    def read(self) -> HostReading:
        cur = self.counters()
        r = rates(self._prev, cur)
        self._prev = cur
        vm = self.ps.virtual_memory()
        return HostReading(
            float(self.ps.cpu_percent(interval=None)),
            float(vm.total - vm.available),
            float(vm.total),
            *r,
        )

    def sample(self) -> dict[str, Any]:
        return host_sample_columns(self.node, self.clock_ns(), self.read())
