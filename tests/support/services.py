"""Real services in their own processes, started through ``tracetop.procs.ServiceProcess`` (the
one launcher: it spawns, pumps output, waits for the announce line and stops by signal).

    c = start_collector(tmp_path)                      # 127.0.0.1, a free port picked by the collector
    c = start_collector(tmp_path, listen="unix")       # a unix socket in tmp_path
    c.addr, c.db, c.proc, c.metrics_port; c.stop()     # SIGTERM, wait, returns the exit code
    scrape_metrics(c.metrics_port)                     # {"name{labels}": value} from /metrics
    a = start_agent(c.addr, sock, spool)               # the node agent, relaying to c
    a.scrape(); a.wait_drained(); a.proc
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT
from tracetop import procs
from tracetop.procs import ServiceProcess


@dataclass
class CollectorProc:
    """A collector child process (tracetop.procs.ServiceProcess) under the names the tests use."""

    service: ServiceProcess
    db: Path

    @property
    def addr(self) -> str:
        return self.service.address

    @property
    def proc(self) -> subprocess.Popen:
        return self.service.proc  # type: ignore[return-value]

    @property
    def metrics_port(self) -> int | None:
        return self.service.metrics_port

    @property
    def output(self) -> list[str]:
        return list(self.service.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig` (SIGTERM: flush and exit 0; SIGKILL: die now) and wait for the exit code."""
        return self.service.stop(sig, timeout_s)

    def text(self) -> str:
        return self.service.text()


def start_collector(
    tmp_path: Path,
    listen: str | None = None,
    *,
    db: Path | None = None,
    extra_args: list[str] = (),  # type: ignore[assignment]
    metrics: bool = False,
    timeout_s: float = 60.0,
) -> CollectorProc:
    """Run `python -m collector` and wait until it prints where it listens.

    listen: None = 127.0.0.1 on a port the collector picks (port 0, race-free), "unix" = a socket
    in tmp_path, or any explicit address.
    """
    db = db or tmp_path / "collector.duckdb"
    if listen is None:
        listen = "127.0.0.1:0"
    elif listen == "unix":
        listen = f"unix://{tmp_path / 'collector.sock'}"
    service = procs.collector(db, listen, metrics=metrics, extra_args=extra_args, cwd=ROOT)
    try:
        service.start(timeout_s)
    except procs.ServiceError as e:
        raise RuntimeError(str(e)) from None
    return CollectorProc(service, db)


def scrape_metrics(port: int) -> dict[str, float]:
    """The collector's Prometheus page as {"name{labels}": value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out




@dataclass
class AgentProc:
    service: ServiceProcess
    token: str | None = None  # /metrics demands it when the agent has a token file

    def _metrics(self) -> str:
        req = urllib.request.Request(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                     headers={"Authorization": f"Bearer {self.token}"} if self.token else {})
        return urllib.request.urlopen(req, timeout=10).read().decode()

    @property
    def proc(self) -> subprocess.Popen:
        return self.service.proc  # type: ignore[return-value]

    @property
    def metrics_port(self) -> int:
        return self.service.metrics_port  # type: ignore[return-value]

    @property
    def output(self) -> list[str]:
        return list(self.service.lines)

    def scrape(self) -> dict[str, float]:
        """name -> value summed over label sets."""
        body = self._metrics()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def scrape_text(self) -> str:
        return self._metrics()

    def wait_drained(self, timeout_s: float = 120.0) -> None:
        """Until the collector has acked everything the agent holds (hooks' batches and its own)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self.scrape()
            if (
                m.get("tracetop_agent_unacked_batches", 1) == 0
                and m.get("tracetop_agent_spool_bytes", 1) == 0
            ):
                return
            time.sleep(0.2)
        raise AssertionError(
            f"agent did not drain its spool in {timeout_s}s: {self.scrape()}\n" + "\n".join(self.output)
        )


def start_agent(collector: str, sock: str, spool: Path, *extra: str, timeout_s: float = 60.0) -> AgentProc:
    service = procs.agent(collector, sock, spool_dir=spool, extra_args=["--metrics-port", "0", *extra], cwd=ROOT)
    try:
        service.start(timeout_s)
    except procs.ServiceError as e:
        raise RuntimeError(str(e)) from None
    token = None
    for flag in ("--metrics-token-file", "--token-file"):  # the first of them guards /metrics
        if flag in extra:
            token = Path(extra[extra.index(flag) + 1]).read_text().split()[0]
            break
    return AgentProc(service, token)
