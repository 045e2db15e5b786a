"""One way to run a tracetop service (collector, agent) as a child process and know where it listens.

Tests, benchmarks and the demo all start collectors and agents this way:

    c = procs.collector(db, "127.0.0.1:0", metrics=True).start()   # waits for its announce line
    c.address, c.metrics_port, c.text()
    c.stop()            # SIGTERM: the collector commits and acks everything, exit code returned
    c.kill(); c.start() # kill -9 and a restart on the same file and address (chaos)

The announce lines are defined here, once: the services print them with ``announce_*`` and this
module parses them with the matching pattern, so the two cannot drift apart.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tracetop.errors import TracetopError

_COLLECTOR_RE = re.compile(
    r"tracetop collector: listening on (?P<address>\S+), db (?P<db>\S+?)(?:, metrics on 127\.0\.0\.1:(?P<metrics_port>\d+))?$"
)
_AGENT_RE = re.compile(
    r"tracetop agent: listening on (?P<address>[^;]+); (?P<gpus>\d+) GPUs; shipping to (?P<collector>\S+); "
    r"spool (?P<spool>\S+?)(?:, metrics on https?://[^:]+:(?P<metrics_port>\d+)/metrics)?$"
)


def announce_collector(address: str, db: str, metrics_port: int | None) -> str:
    metrics = f", metrics on 127.0.0.1:{metrics_port}" if metrics_port is not None else ""
    return f"tracetop collector: listening on {address}, db {db}{metrics}"


def announce_agent(addresses: Sequence[str], gpus: int, collector: str, spool: str, metrics_url: str | None) -> str:
    metrics = f", metrics on {metrics_url}" if metrics_url else ""
    return f"tracetop agent: listening on {', '.join(addresses)}; {gpus} GPUs; shipping to {collector}; spool {spool}{metrics}"


class ServiceError(TracetopError, RuntimeError):
    """A service exited or stayed silent instead of announcing where it listens; str() has its output."""


class ServiceProcess:
    """A child process that announces where it listens with one line on stdout."""

    def __init__(self, argv: Sequence[str], announce: re.Pattern[str], *, name: str, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, log_path: Path | None = None, nice: int = 0,
                 keep_lines: int = 5000) -> None:
        self.argv = list(argv)
        self.announce = announce
        self.name = name
        self.env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.cwd = cwd
        self.log_path = log_path
        self.nice = nice
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.proc: subprocess.Popen[str] | None = None
        self.match: re.Match[str] | None = None

    # ---- what it announced
    @property
    def address(self) -> str:
        return self.match["address"] if self.match else ""

    @property
    def metrics_port(self) -> int | None:
        if self.match is None or "metrics_port" not in self.announce.groupindex or not self.match["metrics_port"]:
            return None
        return int(self.match["metrics_port"])

    def text(self) -> str:
        return "\n".join(self.lines)

    # ---- life
    def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        """Spawn it and return once it announced itself; ServiceError if it exits or stays silent."""
        self.match = None
        nice = self.nice
        self.proc = subprocess.Popen(
            self.argv, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        ready = threading.Event()
        proc = self.proc

        def pump() -> None:
            assert proc.stdout is not None
            log = open(self.log_path, "a") if self.log_path else None  # noqa: SIM115 - closed below
            try:
                for line in proc.stdout:
                    line = line.rstrip("\n")
                    self.lines.append(line)
                    if log:
                        log.write(line + "\n")
                        log.flush()
                    if not ready.is_set():
                        m = self.announce.search(line)
                        if m:
                            self.match = m
                            ready.set()
            finally:
                ready.set()
                if log:
                    log.close()

        threading.Thread(target=pump, name=f"{self.name}-output", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.05):
            if time.monotonic() > deadline:
                self.kill()
                raise ServiceError(f"{self.name} did not announce itself within {timeout_s:g} s:\n{self._tail()}")
        if self.match is None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise ServiceError(f"{self.name} exited ({proc.returncode}) before listening:\n{self._tail()}")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)  # type: ignore[union-attr]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send ``sig`` (SIGTERM: orderly exit) and return the exit code; kills it after timeout_s."""
        if self.proc is None:
            return 0
        self.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise

    def kill(self) -> None:
        """kill -9, and wait for it."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        if self.proc is not None:
            self.proc.wait()

    def _tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])


def collector(db: str | os.PathLike[str], listen: str = "127.0.0.1:0", *, metrics: bool = False,
              extra_args: Sequence[str] = (), **kw) -> ServiceProcess:
    """`python -m collector` on ``db``; listen "127.0.0.1:0" lets it pick a free port (race-free)."""
    argv = [sys.executable, "-m", "collector", "--db", str(db), "--listen", listen, *extra_args]
    if metrics:
        argv += ["--metrics-port", "0"]
    return ServiceProcess(argv, _COLLECTOR_RE, name="collector", **kw)


def agent(collector_address: str, listen: str, *, spool_dir: str | os.PathLike[str], extra_args: Sequence[str] = (),
          **kw) -> ServiceProcess:
    """`python -m agent` relaying to ``collector_address``, listening on ``listen`` with a disk spool."""
    argv = [sys.executable, "-m", "agent", "--collector", collector_address, "--listen", listen,
            "--spool-dir", str(spool_dir), *extra_args]
    return ServiceProcess(argv, _AGENT_RE, name="agent", **kw)
