"""Real receivers for the export tests: Alertmanager and promtool (Debian packages), an HTTP
receiver that records what it is sent, an OTLP/gRPC receiver, and dead endpoints.

A missing tool FAILS the test with how to install it (never a skip into green)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.wait import wait_for as wait_until  # noqa: F401  (the tests here call it so)

PACKAGES = {"prometheus-alertmanager": "prometheus-alertmanager", "promtool": "prometheus", "amtool": "prometheus-alertmanager"}


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pkg = PACKAGES.get(tool, tool)
        pytest.fail(
            f"{tool} is not installed. `make setup` installs it where apt is available and it runs as root "
            f"(scripts/setup_external.sh); by hand: apt-get update && apt-get install -y --no-install-recommends {pkg}",
            pytrace=False,
        )
    return path


# ---- an HTTP receiver ------------------------------------------------------------------------
class Receiver:
    """Records every JSON body POSTed to it. `fail_first=N` answers HTTP 500 to the first N."""

    def __init__(self, fail_first: int = 0) -> None:
        self.bodies: list[object] = []
        self.fail_first = fail_first
        self.requests = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(n)
                outer.requests += 1
                if outer.requests <= outer.fail_first:
                    self.send_response(500)
                    self.end_headers()
                    return
                outer.bodies.append(json.loads(raw))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self._t = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._t.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- dead endpoints ----------------------------------------------------------------------------
class Blackhole:
    """A TCP port that completes the handshake (the kernel's backlog) and never answers: the worst
    receiver, every request waits for its client's timeout."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.port = self.sock.getsockname()[1]
        self.addr = f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.sock.close()


def refused_port() -> int:
    """A port nothing listens on (connections are refused at once)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- Alertmanager ------------------------------------------------------------------------------
class Alertmanager:
    """A real prometheus-alertmanager on 127.0.0.1 (port 0), no gossip, temp storage, routing every
    alert to `webhook_url` at once (group_wait 0s unless given, group_interval 1s) with send_resolved."""

    def __init__(self, tmp_path: Path, webhook_url: str, *, group_by: str = "['...']", extra: str = "",
                 group_wait: str = "0s") -> None:
        binary = need("prometheus-alertmanager")
        cfg = tmp_path / "am.yml"
        cfg.write_text(
            "route:\n"
            "  receiver: hook\n"
            f"  group_by: {group_by}\n"
            f"  group_wait: {group_wait}\n"
            "  group_interval: 1s\n"
            "  repeat_interval: 1h\n"
            "receivers:\n"
            "  - name: hook\n"
            "    webhook_configs:\n"
            f"      - url: {webhook_url}\n"
            "        send_resolved: true\n"
            + extra
        )
        storage = tmp_path / "am-data"
        storage.mkdir()
        self.log_path = tmp_path / "am.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.path={storage}", "--web.listen-address=127.0.0.1:0",
             "--cluster.listen-address="],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        pat = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')

        def port():
            if self.proc.poll() is not None:
                raise AssertionError(f"alertmanager exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            m = pat.search(self.log_path.read_text())
            return m and int(m.group(1))

        self.port = wait_until(port, 30, "alertmanager to listen")
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: self._get("/-/ready", raw=True) is not None, 30, "alertmanager ready")

    def _get(self, path: str, raw: bool = False):
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                body = r.read().decode()
        except OSError:
            return None
        return body if raw else json.loads(body)

    def alerts(self) -> list[dict]:
        return self._get("/api/v2/alerts") or []

    def metric(self, name_and_labels: str) -> float:
        for line in (self._get("/metrics", raw=True) or "").splitlines():
            key, _, value = line.rpartition(" ")
            if key == name_and_labels:
                return float(value)
        return 0.0

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


# ---- an OTLP/gRPC receiver ----------------------------------------------------------------------
class OtlpReceiver:
    """The OTLP MetricsService, in process: every ExportMetricsServiceRequest is kept."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import (
            metrics_service_pb2,
            metrics_service_pb2_grpc,
        )

        self.requests: list = []
        outer = self

        class Rx(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802
                outer.requests.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Rx(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = f"127.0.0.1:{self.port}"
        self.server.start()

    def points(self) -> dict[tuple[str, tuple], tuple[float, str]]:
        """The latest data point of each (metric name, sorted attributes): (value, unit)."""
        out: dict = {}
        for req in self.requests:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        data = m.gauge if m.HasField("gauge") else m.sum if m.HasField("sum") else None
                        if data is None:
                            continue
                        for p in data.data_points:
                            attrs = tuple(sorted((a.key, a.value.string_value) for a in p.attributes))
                            v = p.as_double if p.HasField("as_double") else float(p.as_int)
                            out[(m.name, attrs)] = (v, m.unit)
        return out

    def resources(self) -> list[dict[str, str]]:
        return [{a.key: a.value.string_value for a in rm.resource.attributes}
                for req in self.requests for rm in req.resource_metrics]

    def close(self) -> None:
        self.server.stop(0)


def promtool_check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([need("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
