"""Real agent and hook processes for the relay tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tracetop import procs
from tracetop.procs import ServiceProcess

ROOT = Path(__file__).resolve().parents[2]
HOOK = Path(__file__).with_name("hook_proc.py")


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


def start_hook(
    endpoint: str, rank: int, n: int, duration_s: float, run_id: str = "relay-test"
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HOOK), endpoint, str(rank), str(n), str(duration_s), run_id],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_hooks(hooks: list[subprocess.Popen], timeout_s: float = 300.0) -> list[str]:
    outs = []
    for h in hooks:
        out, _ = h.communicate(timeout=timeout_s)
        assert h.returncode == 0, out
        outs.append(out)
    return outs


def exactly_once(db: Path) -> dict[int, tuple[int, int]]:
    """rank -> (rows, distinct steps) of the hooks' STEP rows; every row must be one a hook made."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        got = {
            int(r): (int(c), int(d))
            for r, c, d in con.execute(
                "SELECT rank, count(*), count(DISTINCT step) FROM step WHERE run_id = 'relay-test' GROUP BY rank"
            ).fetchall()
        }
        bad_steps = con.execute(
            "SELECT count(*) FROM step WHERE run_id = 'relay-test' AND (step < 0 OR data_wait_ns <> 1)"
        ).fetchone()[0]
    finally:
        con.close()
    assert bad_steps == 0
    return got
