"""The Prometheus exposition: sampled values under unit-named metrics, nulls left out."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.fake_nvml import FakeGPU, FakeNVML
from agent.gpu import GPUSampler
from agent.host import HostSampler
from agent.metrics import AgentMetrics
from agent.nvml import NVML


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_exposition_names_units_and_nulls():
    nvml = NVML(
        FakeNVML([FakeGPU(util_pct=77, power_mw=123_000), FakeGPU(unsupported={"nvmlDeviceGetPowerUsage"})])
    )
    nvml.start()
    gpu, proc = GPUSampler(nvml, "nodeA").sample()
    reg = CollectorRegistry()
    m = AgentMetrics(
        "nodeA", registry=reg, stats=lambda: {"spool_bytes": 42, "spool_full": 3, "relay_batches": 9}
    )
    m.update(gpu=gpu, proc=proc, host=HostSampler("nodeA").sample())
    s = _samples(generate_latest(reg).decode())
    g0 = (("gpu", "0"), ("node", "nodeA"), ("uuid", "GPU-fake-0000-0000-0000-000000000000"))
    g1 = (("gpu", "1"), ("node", "nodeA"), ("uuid", "GPU-fake-0001-0000-0000-000000000000"))
    assert s[("tracetop_gpu_utilization_pct", g0)] == 77
    assert s[("tracetop_gpu_power_mw", g0)] == 123_000
    assert ("tracetop_gpu_power_mw", g1) not in s  # null is not exported as 0
    assert s[("tracetop_gpu_temperature_c", g1)] == 60
    assert s[("tracetop_gpu_pcie_tx_bytes_total", g0)] == 1_000_000  # a counter
    assert s[("tracetop_host_memory_total_bytes", (("node", "nodeA"),))] > 0
    assert s[("tracetop_agent_spool_bytes", (("node", "nodeA"),))] == 42
    assert s[("tracetop_agent_spool_full_events_total", (("node", "nodeA"),))] == 3


def test_http_endpoint_serves_latest_sample():
    reg = CollectorRegistry()
    m = AgentMetrics("n", registry=reg)
    nvml = NVML(FakeNVML(1))
    nvml.start()
    port = m.serve(0)
    try:
        m.update(gpu=GPUSampler(nvml, "n").sample()[0])
        nvml.backend.gpus[0].temp_c = 81
        m.update(gpu=GPUSampler(nvml, "n").sample()[0])
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        m.close()
    temps = [v for (name, _), v in _samples(body).items() if name == "tracetop_gpu_temperature_c"]
    assert temps == [81]
