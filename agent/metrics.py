"""The agent's Prometheus endpoint: the latest GPU and host samples, plus relay counters.

A prometheus_client custom collector (one `collect()` method) over the latest sampled columns, in
its own CollectorRegistry (a parameter, so tests can pass theirs). Names follow dcgm-exporter's
spirit with the unit in the name; labels `node`, `gpu`, `uuid`. A null field (NaN: the GPU does
not report it) is not exported at all, rather than exported as 0.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: GPU_SAMPLE column -> (metric name, help, is a cumulative counter)
GPU_METRICS: dict[str, tuple[str, str, bool]] = {
    "util_pct": ("tracetop_gpu_utilization_pct", "GPU utilization (percent of time a kernel ran)", False),
    "mem_util_pct": ("tracetop_gpu_memory_utilization_pct", "Memory controller utilization (percent)", False),
    "mem_used_bytes": ("tracetop_gpu_memory_used_bytes", "Framebuffer memory used", False),
    "mem_total_bytes": ("tracetop_gpu_memory_total_bytes", "Framebuffer memory total", False),
    "power_mw": ("tracetop_gpu_power_mw", "Power draw in milliwatts", False),
    "energy_mj": ("tracetop_gpu_energy_mj", "Energy consumed since the driver loaded, millijoules", True),
    "temp_c": ("tracetop_gpu_temperature_c", "GPU temperature, degrees Celsius", False),
    "sm_clock_mhz": ("tracetop_gpu_sm_clock_mhz", "SM clock in MHz", False),
    "clock_event_reasons": (
        "tracetop_gpu_clock_event_reasons",
        "Clock event (throttle) reasons bitmask",
        False,
    ),
    "pcie_tx_bytes": ("tracetop_gpu_pcie_tx_bytes", "PCIe bytes transmitted", True),
    "pcie_rx_bytes": ("tracetop_gpu_pcie_rx_bytes", "PCIe bytes received", True),
    "nvlink_tx_bytes": ("tracetop_gpu_nvlink_tx_bytes", "NVLink data bytes transmitted, all links", True),
    "nvlink_rx_bytes": ("tracetop_gpu_nvlink_rx_bytes", "NVLink data bytes received, all links", True),
    "ecc_uncorrected": ("tracetop_gpu_ecc_uncorrected_errors", "Uncorrected ECC errors (volatile)", True),
    "remapped_rows": (
        "tracetop_gpu_remapped_rows",
        "Remapped memory rows (correctable + uncorrectable)",
        False,
    ),
    "ecc_corrected": ("tracetop_gpu_ecc_corrected_errors", "Corrected ECC errors (volatile)", True),
    "remap_pending": ("tracetop_gpu_remap_pending", "1 if a row remap waits for a GPU reset", False),
    "remap_failure": ("tracetop_gpu_remap_failure", "1 if a row remapping failed", False),
    "pcie_replays": ("tracetop_gpu_pcie_replays", "PCIe replay counter", True),
    "pcie_correctable": ("tracetop_gpu_pcie_correctable_errors", "PCIe correctable errors", True),
    "temp_slowdown_c": ("tracetop_gpu_slowdown_temperature_c", "Slowdown temperature threshold, Celsius", False),
    "power_limit_mw": ("tracetop_gpu_power_limit_mw", "Enforced power limit in milliwatts", False),
}

HOST_METRICS: dict[str, tuple[str, str]] = {
    "cpu_pct": ("tracetop_host_cpu_pct", "Host CPU utilization (percent of all cores)"),
    "mem_used_bytes": ("tracetop_host_memory_used_bytes", "Host memory in use (total - available)"),
    "mem_total_bytes": ("tracetop_host_memory_total_bytes", "Host memory total"),
    "net_rx_bytes_per_s": ("tracetop_host_network_rx_bytes_per_s", "Network receive throughput"),
    "net_tx_bytes_per_s": ("tracetop_host_network_tx_bytes_per_s", "Network transmit throughput"),
    "disk_read_bytes_per_s": ("tracetop_host_disk_read_bytes_per_s", "Disk read throughput"),
    "disk_write_bytes_per_s": ("tracetop_host_disk_write_bytes_per_s", "Disk write throughput"),
}

#: relay/agent stat key -> (metric name, help, is a counter)
AGENT_METRICS: dict[str, tuple[str, str, bool]] = {
    "relay_batches": ("tracetop_agent_relay_batches", "Hook batches spooled and acked by the relay", True),
    "relay_rows": ("tracetop_agent_relay_rows", "Hook rows spooled and acked by the relay", True),
    "relay_duplicates": (
        "tracetop_agent_relay_duplicate_batches",
        "Hook batches resent after being spooled",
        True,
    ),
    "relay_rejected": ("tracetop_agent_relay_rejected_batches", "Malformed hook batches refused", True),
    "spool_full": (
        "tracetop_agent_spool_full_events",
        "Hook batches refused because the spool was full",
        True,
    ),
    "spool_bytes": (
        "tracetop_agent_spool_bytes",
        "Bytes on the disk spool not yet acked by the collector",
        False,
    ),
    "unacked_batches": ("tracetop_agent_unacked_batches", "Batches not yet acked by the collector", False),
    "collector_connected": (
        "tracetop_agent_collector_connected",
        "1 while the collector stream is up",
        False,
    ),
    "xid_events": ("tracetop_agent_xid_events", "XID critical events seen", True),
    "clock_offset_ns": ("tracetop_agent_clock_offset_ns", "Collector clock minus this node's clock", False),
    "clock_rtt_ns": ("tracetop_agent_clock_rtt_ns", "Round trip of the best clock exchange", False),
}


def _finite(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _decode_str(col: Any, n: int) -> list[str]:
    if isinstance(col, tuple):  # (codes, dictionary)
        codes, d = col
        return [d[int(c)] for c in codes]
    return [str(x) for x in col][:n]


class AgentMetrics:
    """Holds the latest samples and exposes them to a Prometheus registry."""

    def __init__(
        self,
        node: str,
        *,
        registry: CollectorRegistry | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.node = node
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.stats = stats
        self._lock = threading.Lock()
        self._gpu: dict[str, Any] | None = None
        self._proc: dict[str, Any] | None = None
        self._host: dict[str, Any] | None = None
        self.registry.register(self)
        self._server: Any = None

    def update(
        self,
        *,
        gpu: dict[str, Any] | None = None,
        proc: dict[str, Any] | None = None,
        host: dict[str, Any] | None = None,
    ) -> None:
        with self._lock:
            if gpu is not None:
                self._gpu = gpu
            if proc is not None:
                self._proc = proc
            if host is not None:
                self._host = host

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            gpu, proc, host = self._gpu, self._proc, self._host
        yield from gpu_families(self.node, gpu)
        yield from process_families(self.node, proc)
        yield from host_families(self.node, host)
        if self.stats is not None:
            yield from agent_families(self.node, self.stats())

    def serve(self, port: int, addr: str = "127.0.0.1", auth: Any = None) -> int:
        """Start the HTTP endpoint in a thread of its own; returns the bound port (port 0 = any).

        ``auth`` (tracetop.wire.auth.ServerAuth): with a token, a scrape needs ``Authorization:
        Bearer <token>`` (401 otherwise); with TLS it is HTTPS. None or empty: open (loopback only,
        which agent/cli.py enforces)."""
        if auth is not None and auth.closed:
            from tracetop.wire.auth import serve_metrics_http

            server, _thread = serve_metrics_http(port, addr, self.registry, auth)
        else:
            from prometheus_client import start_http_server

            server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def gpu_families(node: str, cols: dict[str, Any] | None) -> Iterator[Metric]:
    if not cols:
        return
    n = len(cols["gpu"])
    gpus = [str(int(g)) for g in cols["gpu"]]
    uuids = _decode_str(cols["uuid"], n)
    for col, (name, help_, counter) in GPU_METRICS.items():
        fam: Any = (CounterMetricFamily if counter else GaugeMetricFamily)(
            name, help_, labels=["node", "gpu", "uuid"]
        )
        values = cols[col]
        for i in range(n):
            v = float(values[i])
            if _finite(v):
                fam.add_metric([node, gpus[i], uuids[i]], v)
        if fam.samples:
            yield fam


def process_families(node: str, cols: dict[str, Any] | None) -> Iterator[Metric]:
    if not cols or not len(cols["pid"]):
        return
    fam = GaugeMetricFamily(
        "tracetop_gpu_process_memory_used_bytes",
        "GPU memory used per process",
        labels=["node", "gpu", "pid", "rank"],
    )
    for g, pid, rank, used in zip(cols["gpu"], cols["pid"], cols["rank"], cols["used_bytes"]):
        if used >= 0:
            fam.add_metric([node, str(int(g)), str(int(pid)), str(int(rank))], float(used))
    yield fam


def host_families(node: str, cols: dict[str, Any] | None) -> Iterator[Metric]:
    if not cols:
        return
    for col, (name, help_) in HOST_METRICS.items():
        v = float(cols[col][0])
        if _finite(v):
            fam = GaugeMetricFamily(name, help_, labels=["node"])
            fam.add_metric([node], v)
            yield fam


def agent_families(node: str, stats: dict[str, Any]) -> Iterator[Metric]:
    for key, (name, help_, counter) in AGENT_METRICS.items():
        v = stats.get(key)
        if v is None or not _finite(float(v)):
            continue
        fam: Any = (CounterMetricFamily if counter else GaugeMetricFamily)(name, help_, labels=["node"])
        fam.add_metric([node], float(v))
        yield fam
