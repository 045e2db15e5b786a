"""GPU sampling: NVML readings -> GPU_SAMPLE / GPU_PROCESS column arrays, and the XID watcher.

The shells (`GPUSampler.read`, `XidWatcher`) only call NVML through `agent.nvml.NVML.query`; the
conversions (`gpu_sample_columns`, `gpu_process_columns`) are pure functions over plain readings.
All GPUs are read first, then the columns are built once per interval (one numpy array per column).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from agent.nvml import NVML

log = logging.getLogger("tracetop.agent.gpu")

NAN = float("nan")
_ALL_LINKS = 0xFFFFFFFF  # scopeId UINT_MAX: NVLink throughput summed over all links
_FAILED = object()
#: current NVML function first, then the deprecated one older drivers still have
_TEMPERATURE = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
_CLOCK_EVENTS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")


class GpuReading(NamedTuple):
    """One GPU at one instant. None = the GPU/driver does not report it (stored as NULL)."""

    gpu: int
    uuid: str
    util_pct: float | None
    mem_util_pct: float | None
    mem_used_bytes: float | None
    mem_total_bytes: float | None
    power_mw: float | None
    energy_mj: float | None
    temp_c: float | None
    sm_clock_mhz: float | None
    clock_event_reasons: float | None  # bitmask
    pcie_tx_bytes: float | None  # cumulative
    pcie_rx_bytes: float | None
    nvlink_tx_bytes: float | None  # cumulative, all links
    nvlink_rx_bytes: float | None
    ecc_uncorrected: float | None  # volatile, since the driver loaded
    remapped_rows: float | None  # correctable + uncorrectable
    ecc_corrected: float | None  # volatile, since the driver loaded
    remap_pending: float | None  # 1.0: a row remap waits for a reset (a flag in NVML, not a count)
    remap_failure: float | None  # 1.0: a remapping failed
    pcie_replays: float | None  # cumulative
    pcie_correctable: float | None  # cumulative
    temp_slowdown_c: float | None  # the slowdown threshold: thermal margin = this - temp_c
    power_limit_mw: float | None  # enforced


class ProcReading(NamedTuple):
    gpu: int
    pid: int
    used_bytes: int  # -1 where NVML does not say


_METRIC_FIELDS = GpuReading._fields[2:]


def gpu_sample_columns(node: str, now_ns: int, readings: Sequence[GpuReading]) -> dict[str, Any]:
    """GPU_SAMPLE columns (tracetop/events.py) for one interval. None -> NaN (NULL)."""
    n = len(readings)
    cols: dict[str, Any] = {
        "rank": np.full(n, -1, dtype="<i4"),
        "step": np.full(n, -1, dtype="<i8"),
        "start_ns": np.full(n, now_ns, dtype="<i8"),
        "duration_ns": np.zeros(n, dtype="<i8"),
        "node": [node] * n,
        "gpu": np.array([r.gpu for r in readings], dtype="<i4"),
        "uuid": [r.uuid for r in readings],
    }
    # One float matrix for every metric column: rows = GPUs, None -> NaN.
    mat = np.array([[NAN if v is None else v for v in r[2:]] for r in readings], dtype="<f8").reshape(
        n, len(_METRIC_FIELDS)
    )
    for j, name in enumerate(_METRIC_FIELDS):
        cols[name] = np.ascontiguousarray(mat[:, j])
    return cols


def gpu_process_columns(
    node: str, now_ns: int, procs: Sequence[ProcReading], rank_of_pid: Callable[[int], int] | None = None
) -> dict[str, Any]:
    """GPU_PROCESS columns: per-process GPU memory, `rank` from the pid (-1 when unknown)."""
    n = len(procs)
    pids = np.array([p.pid for p in procs], dtype="<i4")
    ranks = np.array([rank_of_pid(int(p)) if rank_of_pid else -1 for p in pids], dtype="<i4")
    return {
        "rank": ranks,
        "step": np.full(n, -1, dtype="<i8"),
        "start_ns": np.full(n, now_ns, dtype="<i8"),
        "duration_ns": np.zeros(n, dtype="<i8"),
        "node": [node] * n,
        "gpu": np.array([p.gpu for p in procs], dtype="<i4"),
        "pid": pids,
        "used_bytes": np.array([p.used_bytes for p in procs], dtype="<i8"),
    }


def _num(v: Any) -> float | None:
    return None if v is None else float(v)


class GPUSampler:
    """Reads every GPU through the NVML funnel. `nvml` must be started."""

    def __init__(
        self,
        nvml: NVML,
        node: str,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        rank_of_pid: Callable[[int], int] | None = None,
    ) -> None:
        self.nvml = nvml
        self.node = node
        self.clock_ns = clock_ns
        self.rank_of_pid = rank_of_pid
        b = nvml.backend
        self._c = {
            "temp": b.NVML_TEMPERATURE_GPU,
            "sm": b.NVML_CLOCK_SM,
            "ecc_type": b.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            "ecc_counter": b.NVML_VOLATILE_ECC,
            "ecc_corrected": b.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            "slowdown": b.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
        }
        self._field_ids = [
            b.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
            b.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
            (b.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _ALL_LINKS),
            (b.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _ALL_LINKS),
            b.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS,
        ]
        self._chosen: dict[tuple[int, str], str] = {}
        q = nvml.query
        self.uuids = []
        for i, h in enumerate(nvml.handles):
            u = q("nvmlDeviceGetUUID", h)
            self.uuids.append(u.decode() if isinstance(u, bytes) else (u or f"gpu{i}"))

    def _first(self, gpu: int, names: tuple[str, ...], *args: Any) -> Any:
        """The current NVML function, else its deprecated predecessor (older drivers lack the new
        symbol). The first one that answers is remembered per GPU."""
        key = (gpu, names[0])
        chosen = self._chosen.get(key)
        if chosen is not None:
            return self.nvml.query(chosen, *args)
        for name in names:
            v = self.nvml.query(name, *args, default=_FAILED)
            if v is not _FAILED:
                self._chosen[key] = name
                return v
        self._chosen[key] = names[0]  # none works here: one (silent) failing call per interval from now on
        return None

    def read(self) -> tuple[list[GpuReading], list[ProcReading]]:
        q = self.nvml.query
        c = self._c
        readings: list[GpuReading] = []
        procs: list[ProcReading] = []
        for i, h in enumerate(self.nvml.handles):
            util = q("nvmlDeviceGetUtilizationRates", h)
            mem = q("nvmlDeviceGetMemoryInfo", h)
            rows = q("nvmlDeviceGetRemappedRows", h)
            tx, rx, nvtx_kib, nvrx_kib, pcie_corr = self.nvml.field_values(h, self._field_ids)
            readings.append(
                GpuReading(
                    gpu=i,
                    uuid=self.uuids[i],
                    util_pct=None if util is None else float(util.gpu),
                    mem_util_pct=None if util is None else float(util.memory),
                    mem_used_bytes=None if mem is None else float(mem.used),
                    mem_total_bytes=None if mem is None else float(mem.total),
                    power_mw=_num(q("nvmlDeviceGetPowerUsage", h)),
                    energy_mj=_num(q("nvmlDeviceGetTotalEnergyConsumption", h)),
                    temp_c=_num(self._first(i, _TEMPERATURE, h, c["temp"])),
                    sm_clock_mhz=_num(q("nvmlDeviceGetClockInfo", h, c["sm"])),
                    clock_event_reasons=_num(self._first(i, _CLOCK_EVENTS, h)),
                    pcie_tx_bytes=tx,
                    pcie_rx_bytes=rx,
                    nvlink_tx_bytes=None if nvtx_kib is None else nvtx_kib * 1024.0,
                    nvlink_rx_bytes=None if nvrx_kib is None else nvrx_kib * 1024.0,
                    ecc_uncorrected=_num(
                        q("nvmlDeviceGetTotalEccErrors", h, c["ecc_type"], c["ecc_counter"])
                    ),
                    remapped_rows=None if rows is None else float(rows[0] + rows[1]),
                    ecc_corrected=_num(
                        q("nvmlDeviceGetTotalEccErrors", h, c["ecc_corrected"], c["ecc_counter"])
                    ),
                    remap_pending=None if rows is None else float(bool(rows[2])),
                    remap_failure=None if rows is None else float(bool(rows[3])),
                    pcie_replays=_num(q("nvmlDeviceGetPcieReplayCounter", h)),
                    pcie_correctable=pcie_corr,
                    temp_slowdown_c=_num(q("nvmlDeviceGetTemperatureThreshold", h, c["slowdown"])),
                    power_limit_mw=_num(q("nvmlDeviceGetEnforcedPowerLimit", h)),
                )
            )
            for p in q("nvmlDeviceGetComputeRunningProcesses", h) or ():
                used = p.usedGpuMemory
                procs.append(ProcReading(i, int(p.pid), -1 if used is None else int(used)))
        return readings, procs

    def sample(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(GPU_SAMPLE columns, GPU_PROCESS columns) for now."""
        now = self.clock_ns()
        readings, procs = self.read()
        return (
            gpu_sample_columns(self.node, now, readings),
            gpu_process_columns(self.node, now, procs, self.rank_of_pid),
        )


#: Short descriptions of the XIDs that matter most in training (NVIDIA's XID catalogue).
XID_DESCRIPTIONS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def xid_columns(node: str, events: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
    """XID columns from (time_ns, gpu, xid) events."""
    n = len(events)
    return {
        "rank": np.full(n, -1, dtype="<i4"),
        "step": np.full(n, -1, dtype="<i8"),
        "start_ns": np.array([e[0] for e in events], dtype="<i8"),
        "duration_ns": np.zeros(n, dtype="<i8"),
        "node": [node] * n,
        "gpu": np.array([e[1] for e in events], dtype="<i4"),
        "xid": np.array([e[2] for e in events], dtype="<i8"),
        "description": [XID_DESCRIPTIONS.get(e[2], "see NVIDIA XID catalogue") for e in events],
    }


class XidWatcher:
    """A thread of its own blocking in nvmlEventSetWait_v2; each XID critical event is handed to
    `on_xid(time_ns, gpu, xid)`. Registration a GPU refuses is logged once and skipped."""

    def __init__(
        self,
        nvml: NVML,
        on_xid: Callable[[int, int, int], None],
        *,
        wait_ms: int = 1000,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.nvml = nvml
        self.on_xid = on_xid
        self.wait_ms = wait_ms
        self.clock_ns = clock_ns
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered: list[int] = []

    def start(self) -> XidWatcher:
        q = self.nvml.query
        b = self.nvml.backend
        self._set = q("nvmlEventSetCreate")
        if self._set is None:
            return self
        failed = object()
        self.registered = [
            i
            for i, h in enumerate(self.nvml.handles)
            if q("nvmlDeviceRegisterEvents", h, b.nvmlEventTypeXidCriticalError, self._set, default=failed)
            is not failed
        ]
        if not self.registered:
            return self
        self._thread = threading.Thread(target=self._run, name="tracetop-xid", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        b = self.nvml.backend
        timeout_cls = b.NVMLError_Timeout
        errors = 0
        while not self._stop.is_set():
            try:
                data = self.nvml.query(
                    "nvmlEventSetWait_v2", self._set, self.wait_ms, passthrough=(timeout_cls,)
                )
            except timeout_cls:
                continue
            if data is None:  # another NVML error, already logged once: back off, do not spin
                errors += 1
                self._stop.wait(min(5.0, 0.1 * errors))
                continue
            errors = 0
            if not data.eventType & b.nvmlEventTypeXidCriticalError:
                continue
            gpu = self.nvml.query("nvmlDeviceGetIndex", data.device)
            try:
                self.on_xid(self.clock_ns(), -1 if gpu is None else int(gpu), int(data.eventData))
            except Exception:  # the consumer's fault must not kill the watcher
                log.exception("XID consumer failed")

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if getattr(self, "_set", None) is not None:
            self.nvml.query("nvmlEventSetFree", self._set)
