"""The agent's /metrics is closed by default, like the collector's: a real agent process, scraped
over real HTTP(S). With a token (``--metrics-token-file``, else the agent's own ``--token-file``)
a scrape without ``Authorization: Bearer`` gets 401 naming what is missing, never the token; with
``--metrics-tls-cert/--metrics-tls-key`` it is HTTPS; a non-loopback ``--metrics-addr`` without
either is refused at start (exit 2, naming both)."""

from __future__ import annotations

import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.collector.test_auth import _ca_and_cert
from tests.support import ROOT
from tests.support.services import start_agent

TOKEN = "agent-metrics-t0ken-9f8e7d"


def _token_file(path: Path, token: str = TOKEN) -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def _get(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=20, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _get_sampled(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    """`_get` until the agent's first GPU sample is in the page (/metrics serves from its start, before
    the first sample: on a cold machine a scrape can come first), or 20 s have passed."""
    import time

    deadline = time.monotonic() + 20
    while True:
        code, body = _get(url, token, context)
        if code != 200 or "tracetop_gpu_temperature_c" in body or time.monotonic() > deadline:
            return code, body
        time.sleep(0.1)


def _agent(tmp_path: Path, *extra: str):
    # the collector is never reached (nothing listens there): the agent spools, /metrics still serves
    return start_agent(f"unix://{tmp_path / 'nobody.sock'}", f"unix://{tmp_path / 'agent.sock'}", tmp_path / "spool",
                       "--fake-gpus", "1", "--interval-s", "0.2", "--clock-interval-s", "0", *extra)


@pytest.mark.parametrize("flag", ["--metrics-token-file", "--token-file"])
def test_metrics_need_the_bearer_token(tmp_path: Path, flag: str) -> None:
    agent = _agent(tmp_path, flag, str(_token_file(tmp_path / "token")))
    try:
        url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
        code, body = _get(url)
        assert code == 401 and "bearer token" in body and TOKEN not in body, body
        code, body = _get(url, "not-the-token")
        assert code == 401 and "not one this collector accepts" in body and "not-the-token" not in body
        code, body = _get_sampled(url, TOKEN)
        assert code == 200 and "tracetop_gpu_temperature_c" in body and "tracetop_agent_spool_bytes" in body
    finally:
        agent.service.stop(timeout_s=30)
    assert TOKEN not in agent.service.text()  # never in the agent's own output


def test_metrics_over_tls(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    d.mkdir()
    _ca_and_cert(d, "agent")
    agent = _agent(tmp_path, "--metrics-tls-cert", str(d / "agent.pem"), "--metrics-tls-key", str(d / "agent.key"))
    try:
        assert agent.service.match["metrics_port"]
        ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
        code, body = _get_sampled(f"https://127.0.0.1:{agent.metrics_port}/metrics", context=ctx)
        assert code == 200 and "tracetop_gpu_temperature_c" in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the HTTPS port
            urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=20).read()
    finally:
        agent.service.stop(timeout_s=30)


def test_non_loopback_metrics_without_tls_or_token_refused(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "agent", "--collector", "127.0.0.1:1", "--listen",
                        f"unix://{tmp_path / 'a.sock'}", "--spool-dir", str(tmp_path / "spool"),
                        "--metrics-port", "0", "--metrics-addr", "0.0.0.0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--metrics-tls-cert" in r.stderr and "--metrics-token-file" in r.stderr
    assert not (tmp_path / "spool").exists() or not any((tmp_path / "spool").iterdir())  # nothing half-written


def test_an_idle_connection_does_not_block_https_scrapes(tmp_path: Path) -> None:
    """The TLS handshake runs on the request's own thread (tracetop.wire.auth.serve_metrics_http,
    shared by the collector and the agent): a TCP connection that never speaks holds only itself."""
    import socket

    d = tmp_path / "pki"
    d.mkdir()
    _ca_and_cert(d, "agent")
    agent = _agent(tmp_path, "--metrics-tls-cert", str(d / "agent.pem"), "--metrics-tls-key", str(d / "agent.key"))
    idle = []
    try:
        ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
        for _ in range(3):  # connected, silent: no ClientHello ever
            idle.append(socket.create_connection(("127.0.0.1", agent.metrics_port), timeout=5))
        for _ in range(3):
            req = urllib.request.Request(f"https://127.0.0.1:{agent.metrics_port}/metrics")
            with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
                assert r.status == 200 and "tracetop_gpu_temperature_c" in r.read().decode()
    finally:
        for s in idle:
            s.close()
        agent.service.stop(timeout_s=30)
