"""The agent wired together in-process: real samplers, relay and shipper (memory transport in
place of the collector), the fake NVML at the hardware edge."""

from __future__ import annotations

import io
import math
import subprocess
import sys
import time

import numpy as np
import pynvml
import pytest

from agent.clock import ClockSample, best, clock_offset_columns, measure, offset_rtt
from agent.daemon import Agent, AgentConfig, PidRanks
from agent.fake_nvml import FakeGPU, FakeNVML
from tracetop.events import Kind
from tracetop.wire.codec import decode_batch, encode_batch
from tracetop.wire.shipper import MemoryTransport, Shipper


def _agent(tmp_path, backend, mem):
    cfg = AgentConfig(
        collector="unused",
        listen=[f"unix://{tmp_path / 'a.sock'}"],
        spool_dir=str(tmp_path / "spool"),
        clock_interval_s=0,
        node="node-x",
    )

    def shipper_factory(endpoint, **kw):
        kw["flush_interval_s"] = 0.05
        return Shipper(None, transport=mem, **kw)

    out = io.StringIO()
    return Agent(cfg, nvml_backend=backend, shipper_factory=shipper_factory, out=out), out


def test_no_nvml_samples_host_only_with_one_notice(tmp_path):
    mem = MemoryTransport()
    agent, out = _agent(tmp_path, FakeNVML(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), mem)
    agent.start()
    try:
        for _ in range(3):
            agent.sample_once()
        assert agent.shipper.flush(10)
    finally:
        agent.stop(1)
    lines = out.getvalue().splitlines()
    assert lines == [
        "tracetop agent: NVML unavailable (libnvidia-ml.so.1 not found): sampling host metrics only; "
        "install the NVIDIA driver (it ships libnvidia-ml.so.1) or run on a node with GPUs"
    ]
    assert len(mem.rows(Kind.HOST_SAMPLE)["cpu_pct"]) == 3
    assert len(mem.rows(Kind.GPU_SAMPLE)["gpu"]) == 0


def test_mixed_support_rows_with_nulls_and_xid_rows(tmp_path):
    mem = MemoryTransport()
    fake = FakeNVML(
        [
            FakeGPU(),
            FakeGPU(
                unsupported={
                    "nvmlDeviceGetTemperatureV",
                    "nvmlDeviceGetTemperature",
                    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                }
            ),
            FakeGPU(unsupported={"nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceRegisterEvents"}),
        ]
    )
    agent, out = _agent(tmp_path, fake, mem)
    agent.start()
    try:
        agent.sample_once()
        fake.gpus[0].util_pct = 99
        agent.sample_once()
        fake.inject_xid(1, 79)
        fake.inject_xid(2, 48)  # GPU 2 refused event registration: never delivered
        deadline = time.monotonic() + 10
        while agent.stats()["xid_events"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent.shipper.flush(10)
    finally:
        agent.stop(1)
    assert out.getvalue() == ""
    g = mem.rows(Kind.GPU_SAMPLE)
    assert list(g["gpu"]) == [0, 1, 2, 0, 1, 2]
    assert list(g["util_pct"]) == [50, 50, 50, 99, 50, 50]
    assert [math.isnan(x) for x in g["temp_c"]] == [False, True, False] * 2
    assert [math.isnan(x) for x in g["nvlink_tx_bytes"]] == [False, True, False] * 2
    assert [math.isnan(x) for x in g["energy_mj"]] == [False, False, True] * 2
    assert set(g["node"]) == {"node-x"} and set(g["rank"]) == {-1}
    x = mem.rows(Kind.XID)
    assert list(x["gpu"]) == [1] and list(x["xid"]) == [79]


def test_pid_to_rank_learnt_from_hook_rows():
    from tracetop.events import SCHEMAS

    n = 2
    cols = {c.name: (["h", "h"] if c.dtype == "str" else np.zeros(n)) for c in SCHEMAS[Kind.HEARTBEAT]}
    cols["rank"] = np.array([5, 6])
    cols["pid"] = np.array([4242, 4343])
    ranks = PidRanks()
    ranks.learn(decode_batch(encode_batch(Kind.HEARTBEAT, cols, source_id="s", seq=1, run_id="r")))
    assert ranks(4242) == 5 and ranks(4343) == 6
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={"RANK": "11"})
    try:
        assert ranks(child.pid) == 11  # torchrun's RANK in the process environment
    finally:
        child.kill()
        child.wait()
    assert ranks(2**22 + 12345) == -1


def test_clock_offset_formula():
    # node clock 1000 ns behind the collector, 300 ns each way, 50 ns in the server
    t0 = 10_000
    t1 = t0 + 300 + 1000
    t2 = t1 + 50
    t3 = t2 - 1000 + 300
    assert offset_rtt(t0, t1, t2, t3) == ClockSample(1000, 600, t3)
    # asymmetric paths bias the offset by half the asymmetry; the min-rtt sample wins
    samples = [offset_rtt(0, 5000, 5000, 5600), offset_rtt(0, 1300, 1350, 650)]
    assert best(samples) == samples[1] and best([]) is None


def test_measure_keeps_min_rtt_and_skips_failures():
    now = iter([0, 100, 400, 500, 600])  # t0 of a failed exchange, then (t0, t3) pairs
    replies = iter([RuntimeError("collector down"), (1_000_400, 1_000_400), (1_000_550, 1_000_550)])

    def exchange(t0):
        r = next(replies)
        if isinstance(r, Exception):
            raise r
        return r

    s = measure(exchange, n=3, clock_ns=lambda: next(now))
    # exchange 2: rtt 300, offset ((1_000_400-100) + (1_000_400-400)) / 2 = 1_000_150
    # exchange 3: rtt 100, offset ((1_000_550-500) + (1_000_550-600)) / 2 = 1_000_000  <- kept
    assert s == ClockSample(1_000_000, 100, 600)
    assert measure(lambda t0: (_ for _ in ()).throw(OSError("down")), n=2) is None
    cols = clock_offset_columns("n", s)
    decode_batch(encode_batch(Kind.CLOCK_OFFSET, cols, source_id="s", seq=1, run_id="r"))


@pytest.mark.parametrize(
    "bad", [["--interval-s", "0"], ["--spool-max-mb", "-1"], ["--metrics-addr", "0.0.0.0"]]
)
def test_cli_refuses_bad_flags(bad, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "agent", "--collector", "127.0.0.1:1", *bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and bad[0] in r.stderr
