"""Shared test helpers: a real collector in its own process.

    c = start_collector(tmp_path)                      # 127.0.0.1, a free port picked by the collector
    c = start_collector(tmp_path, listen="unix")       # a unix socket in tmp_path
    c.addr, c.db, c.proc, c.metrics_port; c.stop()     # SIGTERM, wait, returns the exit code
    scrape_metrics(c.metrics_port)                     # {"name{labels}": value} from /metrics
"""

from __future__ import annotations

import signal
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tracetop import procs
from tracetop.procs import ServiceProcess

ROOT = Path(__file__).resolve().parents[1]


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
