"""GPU and host sampling against the fake NVML backend (pynvml's API and error types)."""

from __future__ import annotations

import logging
import math
import threading
from types import SimpleNamespace

import numpy as np
import pynvml
import pytest

from agent.fake_nvml import FakeGPU, FakeNVML
from agent.gpu import GPUSampler, XidWatcher, gpu_process_columns, gpu_sample_columns, xid_columns
from agent.host import HostCounters, HostSampler, host_sample_columns, rates
from agent.nvml import NVML, NVMLUnavailable
from tracetop.events import SCHEMAS, Kind
from tracetop.wire.codec import decode_batch, encode_batch


def _roundtrip(kind: Kind, cols: dict) -> dict:
    """Encode and decode through the real codec: the columns satisfy the wire contract."""
    d = decode_batch(encode_batch(kind, cols, source_id="agent:t", seq=1, run_id="r1"))
    return d.columns


def test_fake_errors_are_pynvml_errors():
    fake = FakeNVML([FakeGPU(unsupported={"nvmlDeviceGetPowerUsage"})])
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPowerUsage(h)
    with pytest.raises(pynvml.NVMLError):
        fake.nvmlDeviceGetHandleByIndex(5)
    assert fake.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert fake.NVMLError_Timeout is pynvml.NVMLError_Timeout


def test_mixed_support_gives_nulls_logged_once(caplog):
    gpus = [
        FakeGPU(util_pct=91, power_mw=250_000, pcie_tx_bytes=123, nvlink_tx_kib=2),
        FakeGPU(
            unsupported={
                "nvmlDeviceGetPowerUsage",
                "nvmlDeviceGetRemappedRows",
                pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
            }
        ),
        FakeGPU(unsupported={"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetFieldValues"}),
    ]
    nvml = NVML(FakeNVML(gpus))
    nvml.start()
    sampler = GPUSampler(nvml, "node-a", clock_ns=lambda: 42)
    with caplog.at_level(logging.INFO, logger="tracetop.agent.nvml"):
        for _ in range(3):
            cols, procs = sampler.sample()
    cols = _roundtrip(Kind.GPU_SAMPLE, cols)
    assert list(cols["gpu"]) == [0, 1, 2]
    assert cols["util_pct"][0] == 91 and math.isnan(cols["util_pct"][2])
    assert cols["power_mw"][0] == 250_000 and math.isnan(cols["power_mw"][1])
    assert math.isnan(cols["remapped_rows"][1]) and cols["remapped_rows"][0] == 0
    assert cols["pcie_tx_bytes"][0] == 123 and math.isnan(cols["pcie_tx_bytes"][1])
    assert cols["pcie_rx_bytes"][1] == gpus[1].pcie_rx_bytes  # only the one field of the batch is null
    assert cols["nvlink_tx_bytes"][0] == 2 * 1024  # KiB -> bytes
    assert all(math.isnan(cols[c][2]) for c in ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_rx_bytes"))
    assert cols["temp_c"][2] == 60  # the rest of GPU 2 is still there
    # logged once per (function/field, device) although sampled three times
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 5, msgs
    assert sum("nvmlDeviceGetPowerUsage" in m for m in msgs) == 1
    assert ("nvmlDeviceGetPowerUsage", 1) in nvml.unsupported()


def test_older_driver_falls_back_to_deprecated_calls(caplog):
    # A driver without the *V / *EventReasons symbols still has the deprecated twins.
    gpu = FakeGPU(
        temp_c=71,
        clock_event_reasons=4,
        unsupported={"nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons"},
    )
    nvml = NVML(FakeNVML([gpu]))
    nvml.start()
    sampler = GPUSampler(nvml, "n")
    with caplog.at_level(logging.INFO, logger="tracetop.agent.nvml"):
        a, _ = sampler.sample()
        b, _ = sampler.sample()
    assert a["temp_c"][0] == b["temp_c"][0] == 71
    assert a["clock_event_reasons"][0] == b["clock_event_reasons"][0] == 4
    assert len(caplog.records) == 2  # each new symbol reported once, then not asked again


def test_hardware_risk_fields_follow_pynvml():
    """Corrected ECC (nvmlDeviceGetTotalEccErrors with NVML_MEMORY_ERROR_TYPE_CORRECTED), the remapper's
    pending/failure flags (nvmlDeviceGetRemappedRows' 3rd and 4th values), PCIe replays and
    correctable errors, the slowdown threshold and the enforced power limit; unsupported -> NaN."""
    gpus = [
        FakeGPU(ecc_uncorrected=2, ecc_corrected=345, remap_pending=True, pcie_replays=7, pcie_correctable=11,
                temp_slowdown_c=87, power_limit_mw=650_000),
        FakeGPU(remap_failure=True, unsupported={
            "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetEnforcedPowerLimit",
            pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS}),
    ]
    nvml = NVML(FakeNVML(gpus))
    nvml.start()
    cols = _roundtrip(Kind.GPU_SAMPLE, GPUSampler(nvml, "node-a", clock_ns=lambda: 1).sample()[0])
    assert (cols["ecc_uncorrected"][0], cols["ecc_corrected"][0]) == (2, 345)
    assert list(cols["remap_pending"]) == [1, 0] and list(cols["remap_failure"]) == [0, 1]
    assert (cols["pcie_replays"][0], cols["pcie_correctable"][0]) == (7, 11)
    assert (cols["temp_slowdown_c"][0], cols["power_limit_mw"][0]) == (87, 650_000)
    assert all(math.isnan(cols[c][1]) for c in ("pcie_replays", "pcie_correctable", "temp_slowdown_c",
                                                "power_limit_mw"))
    assert cols["ecc_corrected"][1] == 0 and cols["pcie_rx_bytes"][1] == gpus[1].pcie_rx_bytes


def test_missing_binding_is_a_null_not_a_crash():
    nvml = NVML(FakeNVML(1))
    nvml.start()
    assert nvml.query("nvmlDeviceGetSomethingFromTheFuture", nvml.handles[0]) is None
    assert ("nvmlDeviceGetSomethingFromTheFuture", 0) in nvml.unsupported()


def test_gpu_columns_are_pure_and_vectorized():
    from agent.gpu import GpuReading

    r = GpuReading(
        3, "GPU-x", 1.0, 2.0, None, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, None,
        15.0, 0.0, 0.0, 16.0, 17.0, 90.0, 700_000.0,
    )
    cols = gpu_sample_columns("n", 7, [r, r._replace(gpu=4, util_pct=None)])
    assert [c.name for c in SCHEMAS[Kind.GPU_SAMPLE]] == list(cols)
    assert list(cols["gpu"]) == [3, 4] and list(cols["start_ns"]) == [7, 7]
    assert (
        math.isnan(cols["mem_used_bytes"][0])
        and cols["util_pct"][0] == 1.0
        and math.isnan(cols["util_pct"][1])
    )
    assert list(cols["rank"]) == [-1, -1] and list(cols["step"]) == [-1, -1]
    empty = gpu_sample_columns("n", 7, [])
    assert all(len(v) == 0 for v in empty.values())


def test_processes_mapped_to_ranks_by_pid():
    nvml = NVML(
        FakeNVML([FakeGPU(processes=[(100, 5 << 20), (101, 6 << 20)]), FakeGPU(processes=[(102, 7)])])
    )
    nvml.start()
    ranks = {100: 0, 102: 3}
    _, procs = GPUSampler(nvml, "n", rank_of_pid=lambda pid: ranks.get(pid, -1)).sample()
    procs = _roundtrip(Kind.GPU_PROCESS, procs)
    assert list(procs["pid"]) == [100, 101, 102]
    assert list(procs["rank"]) == [0, -1, 3]
    assert list(procs["gpu"]) == [0, 0, 1]
    assert list(procs["used_bytes"]) == [5 << 20, 6 << 20, 7]
    assert gpu_process_columns("n", 1, [])["pid"].dtype == np.dtype("<i4")


def test_no_nvml_library_raises_with_hint():
    nvml = NVML(FakeNVML(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(NVMLUnavailable) as ei:
        nvml.start()
    assert "libnvidia-ml.so.1 not found" in str(ei.value) and "HINT" in str(ei.value)
    assert isinstance(ei.value.__cause__, pynvml.NVMLError_LibraryNotFound)


def test_xid_watcher_delivers_injected_events():
    fake = FakeNVML(3)
    nvml = NVML(fake)
    nvml.start()
    got: list[tuple[int, int, int]] = []
    done = threading.Event()

    def on_xid(t, gpu, xid):
        got.append((t, gpu, xid))
        if len(got) == 2:
            done.set()

    w = XidWatcher(nvml, on_xid, wait_ms=50, clock_ns=lambda: 5).start()
    try:
        assert w.registered == [0, 1, 2]
        fake.inject_xid(2, 79)
        fake.inject_xid(0, 48)
        assert done.wait(10)
    finally:
        w.stop()
    assert got == [(5, 2, 79), (5, 0, 48)]
    cols = _roundtrip(Kind.XID, xid_columns("n", got))
    codes, d = cols["description"]
    assert [d[c] for c in codes] == ["GPU has fallen off the bus", "double bit ECC error"]


def test_host_rates_pure():
    a = HostCounters(10.0, 1000.0, 0.0, None, 50.0)
    b = HostCounters(12.0, 3000.0, 10.0, 5.0, 40.0)
    assert rates(None, b) == (None, None, None, None)
    assert rates(a, b) == (1000.0, 5.0, None, None)  # disk write went backwards: a reset, not a rate
    assert rates(a, a) == (None, None, None, None)


def test_host_sampler_with_injected_psutil():
    t = [100.0]
    state = {"rx": 0, "tx": 0, "rd": 0, "wr": 0}

    class FakePsutil:
        def cpu_percent(self, interval=None):
            return 37.5

        def net_io_counters(self):
            return SimpleNamespace(bytes_recv=state["rx"], bytes_sent=state["tx"])

        def disk_io_counters(self):
            return SimpleNamespace(read_bytes=state["rd"], write_bytes=state["wr"])

        def virtual_memory(self):
            return SimpleNamespace(total=1000, available=400)

    s = HostSampler("n", psutil_mod=FakePsutil(), clock_ns=lambda: 9, mono_s=lambda: t[0])
    t[0] += 2.0
    state.update(rx=4000, tx=2000, rd=600, wr=0)
    cols = _roundtrip(Kind.HOST_SAMPLE, s.sample())
    assert (
        cols["cpu_pct"][0] == 37.5 and cols["mem_used_bytes"][0] == 600 and cols["mem_total_bytes"][0] == 1000
    )
    assert cols["net_rx_bytes_per_s"][0] == 2000 and cols["net_tx_bytes_per_s"][0] == 1000
    assert cols["disk_read_bytes_per_s"][0] == 300 and cols["disk_write_bytes_per_s"][0] == 0


def test_host_sampler_real_psutil():
    cols = HostSampler("n").sample()
    assert [c.name for c in SCHEMAS[Kind.HOST_SAMPLE]] == list(cols)
    assert cols["mem_total_bytes"][0] > 0
    cols2 = host_sample_columns("n", 1, HostSampler("n").read())
    _roundtrip(Kind.HOST_SAMPLE, cols2)
