"""A fake NVML backend with pynvml's API, for tests and demos on machines without GPUs.

`FakeNVML` is a module-like object: the functions the agent calls under their pynvml names, every
`NVML_*` constant, and pynvml's own error classes (`pynvml.NVMLError_NotSupported`, ...), so code
that catches pynvml errors behaves the same on both. Returned values are pynvml's own ctypes
structures (`c_nvmlUtilization_t`, `c_nvmlMemory_t`, `c_nvmlFieldValue_t`, `c_nvmlProcessInfo_t`).

What a test controls:
- `gpus`: a list of `FakeGPU` (values in NVML's units; mutate them between samples);
- `FakeGPU.unsupported`: pynvml function names (e.g. "nvmlDeviceGetPowerUsage") and field ids
  (e.g. pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES) that answer NVMLError_NotSupported;
- `init_error`: an NVML error code raised by nvmlInit (NVML_ERROR_LIBRARY_NOT_FOUND, ...);
- `inject_xid(gpu, xid)`: an XID critical event delivered by nvmlEventSetWait_v2.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import pynvml

NVMLError = pynvml.NVMLError


def _error(code: int) -> BaseException:
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass (NVMLError_NotSupported, ...)


@dataclass
class FakeGPU:
    """One fake device. Units follow NVML (mW, mJ, MHz, °C, bytes, KiB for NVLink counters)."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    util_pct: int = 50
    mem_util_pct: int = 30
    mem_total_bytes: int = 80 * 1024**3
    mem_used_bytes: int = 20 * 1024**3
    power_mw: int = 300_000
    energy_mj: int = 1_000_000
    temp_c: int = 60
    sm_clock_mhz: int = 1980
    clock_event_reasons: int = 0
    pcie_tx_bytes: int = 1_000_000
    pcie_rx_bytes: int = 2_000_000
    nvlink_tx_kib: int = 3_000
    nvlink_rx_kib: int = 4_000
    ecc_uncorrected: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    ecc_corrected: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    pcie_replays: int = 0
    pcie_correctable: int = 0
    temp_slowdown_c: int = 90
    power_limit_mw: int = 700_000
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used bytes)
    unsupported: set[Any] = field(default_factory=set)


class FakeHandle:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<FakeHandle {self.index}>"


class _EventData:
    """Shaped like pynvml.c_nvmlEventData_t (device, eventType, eventData, ...)."""

    __slots__ = ("device", "eventType", "eventData", "gpuInstanceId", "computeInstanceId")

    def __init__(self, device: FakeHandle, event_type: int, data: int) -> None:
        self.device = device
        self.eventType = event_type
        self.eventData = data
        self.gpuInstanceId = 0xFFFFFFFF
        self.computeInstanceId = 0xFFFFFFFF


class _EventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # gpu index -> event type mask
        self.events: queue.Queue[_EventData] = queue.Queue()
        self.freed = False


class FakeNVML:
    """A pynvml stand-in. Pass it where the agent takes an NVML backend."""

    def __init__(
        self,
        gpus: list[FakeGPU] | int = 2,
        *,
        init_error: int | None = None,
        driver_version: str = "570.00.fake",
    ) -> None:
        if isinstance(gpus, int):
            gpus = [FakeGPU() for _ in range(gpus)]
        for i, g in enumerate(gpus):
            if not g.uuid:
                g.uuid = f"GPU-fake-{i:04d}-0000-0000-000000000000"
        self.gpus = gpus
        self.init_error = init_error
        self.driver_version = driver_version
        self.calls = 0
        self._handles = [FakeHandle(i) for i in range(len(gpus))]
        self._initialized = 0
        self._event_sets: list[_EventSet] = []
        self._lock = threading.Lock()

    # Constants and error classes come from pynvml itself.
    def __getattr__(self, name: str) -> Any:
        if name.startswith(
            ("NVML_", "NVMLError", "nvmlEventType", "nvmlClocksEvent", "nvmlTemperature", "c_nvml")
        ):
            return getattr(pynvml, name)
        raise AttributeError(f"FakeNVML has no {name!r} (add it to agent/fake_nvml.py if the agent needs it)")

    # ---- test controls ----
    def inject_xid(self, gpu: int, xid: int) -> None:
        """Deliver an XID critical error for GPU `gpu` to every event set registered for it."""
        with self._lock:
            sets = [
                s
                for s in self._event_sets
                if not s.freed and s.registered.get(gpu, 0) & pynvml.nvmlEventTypeXidCriticalError
            ]
        for s in sets:
            s.events.put(_EventData(self._handles[gpu], pynvml.nvmlEventTypeXidCriticalError, xid))

    # ---- helpers ----
    def _enter(self, name: str, handle: FakeHandle | None = None) -> FakeGPU | None:
        self.calls += 1
        if not self._initialized:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[handle.index]
        if name in gpu.unsupported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # ---- init / system ----
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.calls += 1
        if self.init_error is not None:
            raise _error(self.init_error)
        self._initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._handles[index]

    # ---- device queries ----
    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._enter("nvmlDeviceGetName", handle).name  # type: ignore[union-attr]

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._enter("nvmlDeviceGetUUID", handle).uuid  # type: ignore[union-attr]

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        g = self._enter("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(gpu=g.util_pct, memory=g.mem_util_pct)  # type: ignore[union-attr]

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: Any = None) -> Any:
        g = self._enter("nvmlDeviceGetMemoryInfo", handle)
        assert g is not None
        return pynvml.c_nvmlMemory_t(
            total=g.mem_total_bytes, free=g.mem_total_bytes - g.mem_used_bytes, used=g.mem_used_bytes
        )

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetPowerUsage", handle).power_mw  # type: ignore[union-attr]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj  # type: ignore[union-attr]

    def nvmlDeviceGetTemperatureV(
        self, handle: FakeHandle, sensor: int, version: int = pynvml.nvmlTemperature_v1
    ) -> int:
        g = self._enter("nvmlDeviceGetTemperatureV", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.temp_c  # type: ignore[union-attr]

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:  # deprecated twin
        g = self._enter("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.temp_c  # type: ignore[union-attr]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:  # deprecated twin
        return self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_event_reasons  # type: ignore[union-attr]

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, type: int) -> int:
        g = self._enter("nvmlDeviceGetClockInfo", handle)
        if type != pynvml.NVML_CLOCK_SM:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.sm_clock_mhz  # type: ignore[union-attr]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_event_reasons  # type: ignore[union-attr]

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, errorType: int, counterType: int) -> int:
        g = self._enter("nvmlDeviceGetTotalEccErrors", handle)
        assert g is not None
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return g.ecc_corrected
        return g.ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, device: FakeHandle) -> tuple[int, int, int, int]:
        g = self._enter("nvmlDeviceGetRemappedRows", device)
        assert g is not None
        return (g.remapped_correctable, g.remapped_uncorrectable, int(g.remap_pending), int(g.remap_failure))

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetPcieReplayCounter", handle).pcie_replays  # type: ignore[union-attr]

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeHandle, thresholdType: int) -> int:
        g = self._enter("nvmlDeviceGetTemperatureThreshold", handle)
        if thresholdType != pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.temp_slowdown_c  # type: ignore[union-attr]

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw  # type: ignore[union-attr]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        g = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        assert g is not None
        return [
            pynvml.c_nvmlProcessInfo_t(
                pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, used in g.processes
        ]

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, fieldIds: list[Any]) -> Any:
        g = self._enter("nvmlDeviceGetFieldValues", handle)
        assert g is not None
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        table = {
            pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: g.pcie_tx_bytes,
            pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: g.pcie_rx_bytes,
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: g.nvlink_tx_kib,
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: g.nvlink_rx_kib,
            pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS: g.pcie_correctable,
        }
        for i, fid in enumerate(fieldIds):
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            v = values[i]
            v.fieldId, v.scopeId = fid, scope
            if fid in g.unsupported or fid not in table:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                v.nvmlReturn = pynvml.NVML_SUCCESS
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = table[fid]
        return values

    # ---- events ----
    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        s = _EventSet()
        with self._lock:
            self._event_sets.append(s)
        return s

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: _EventSet) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        eventSet.registered[handle.index] = eventSet.registered.get(handle.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> _EventData:
        self._enter("nvmlEventSetWait_v2")
        try:
            return eventSet.events.get(timeout=max(timeoutms, 0) / 1000.0)
        except queue.Empty:
            raise _error(pynvml.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int) -> _EventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        eventSet.freed = True
