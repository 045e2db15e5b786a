"""Shared test helpers: a real collector in its own process.

    c = start_collector(tmp_path)                      # 127.0.0.1, a free port picked by the collector
    c = start_collector(tmp_path, listen="unix")       # a unix socket in tmp_path
    c.addr, c.db, c.proc, c.metrics_port; c.stop()     # SIGTERM, wait, returns the exit code
    scrape_metrics(c.metrics_port)                     # {"name{labels}": value} from /metrics
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINE = re.compile(r"tracetop collector: listening on (\S+), db (\S+?)(?:, metrics on 127\.0\.0\.1:(\d+))?$")


@dataclass
class CollectorProc:
    addr: str
    db: Path
    proc: subprocess.Popen
    metrics_port: int | None = None
    output: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig` (SIGTERM: flush and exit 0; SIGKILL: die now) and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise

    def text(self) -> str:
        return "\n".join(self.output)


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
    args = [sys.executable, "-m", "collector", "--db", str(db), "--listen", listen, *extra_args]
    if metrics:
        args += ["--metrics-port", "0"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    found: dict[str, re.Match] = {}
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            m = _LINE.search(line)
            if m and not ready.is_set():
                found["m"] = m
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.05):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("collector did not start in time:\n" + "\n".join(lines))
    if "m" not in found:
        proc.wait(10)
        raise RuntimeError(f"collector exited ({proc.returncode}) before listening:\n" + "\n".join(lines))
    m = found["m"]
    return CollectorProc(
        addr=m.group(1), db=db, proc=proc, metrics_port=int(m.group(3)) if m.group(3) else None, output=lines
    )


def scrape_metrics(port: int) -> dict[str, float]:
    """The collector's Prometheus page as {"name{labels}": value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
