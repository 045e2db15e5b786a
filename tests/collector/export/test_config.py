"""Bad --alertmanager / --webhook / --otlp values are refused before anything starts (exit 2), and
the setup script that installs the external tools is never fatal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from collector.export import ExportConfigError, build, check_otlp_endpoint
from tests.support import ROOT

from .tools import need


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--alertmanager", "127.0.0.1:9093"], "--alertmanager '127.0.0.1:9093' is not an http:// or https:// URL"),
        (["--alertmanager", "ftp://am:9093"], "e.g. --alertmanager http://127.0.0.1:9093"),
        (["--alertmanager", "http://am:99999"], "--alertmanager 'http://am:99999': Port out of range"),
        (["--webhook", "hooks.example/x"], "--webhook 'hooks.example/x' is not an http:// or https:// URL"),
        (["--otlp", "localhost"], "--otlp 'localhost' is not HOST:PORT; e.g. --otlp 127.0.0.1:4317"),
        (["--otlp", "grpc://h:4317"], "the scheme must be http or https"),
        (["--otlp", "http://h:4317/v1/metrics"], "OTLP/gRPC takes no path"),
        (["--otlp", "h:4317", "--otlp-interval-s", "0"], "--otlp-interval-s 0.0: give a positive number"),
    ],
)
def test_bad_output_flags_exit_2_and_start_nothing(tmp_path, flags, says):
    db = tmp_path / "c.duckdb"
    out = subprocess.run([sys.executable, "-m", "collector", "--db", str(db), "--listen", "127.0.0.1:0", *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert says in out.stderr, out.stderr
    assert out.stderr.startswith("tracetop collector: ")
    assert not db.exists()  # nothing half-made


def test_env_vars_are_the_fallback_and_flags_win():
    class A:
        alertmanager = None
        webhook = "http://127.0.0.1:1/flag"
        otlp = None

    ex = build(A(), environ={"TRACETOP_ALERTMANAGER": "http://127.0.0.1:2", "TRACETOP_WEBHOOK": "http://x:1/env",
                             "TRACETOP_OTLP": "https://otel.example:4317"})
    try:
        assert [(s.kind, s.url) for s in ex.sinks] == [("alertmanager", "http://127.0.0.1:2/api/v2/alerts"),
                                                        ("webhook", "http://127.0.0.1:1/flag")]
        assert (ex.otlp_endpoint, ex.otlp_insecure) == ("otel.example:4317", False)
    finally:
        ex.close()
    with pytest.raises(ExportConfigError, match=r"--alertmanager 'nope' is not .* \(the value comes from \$TRACETOP_ALERTMANAGER\)"):
        build(A(), environ={"TRACETOP_ALERTMANAGER": "nope"})
    assert check_otlp_endpoint("http://127.0.0.1:4317") == ("127.0.0.1:4317", True)


def _run_setup(path: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", str(ROOT / "scripts" / "setup_external.sh")], capture_output=True,
                          text=True, timeout=60, env={"PATH": path, "HOME": os.environ.get("HOME", "/root")})


def test_setup_script_without_apt_says_what_to_install_and_exits_0(tmp_path):
    out = _run_setup(str(tmp_path))  # nothing on PATH: no tools, no apt-get
    assert out.returncode == 0, out
    assert "missing prometheus-alertmanager promtool tmux and no apt-get here" in out.stderr
    assert "apt-get install -y --no-install-recommends prometheus-alertmanager prometheus tmux" in out.stderr


def test_setup_script_is_a_quiet_no_op_when_every_tool_is_there(tmp_path):
    # stand-ins on PATH for the three tools, and an apt-get that would record being called
    for tool in ("prometheus-alertmanager", "promtool", "tmux"):
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    (tmp_path / "apt-get").write_text(f"#!/bin/sh\ntouch {tmp_path}/apt-called\n")
    (tmp_path / "apt-get").chmod(0o755)
    out = _run_setup(str(tmp_path))
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out
    assert not (tmp_path / "apt-called").exists()


def test_a_missing_tool_fails_the_test_with_how_to_install_it():
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y --no-install-recommends no-such-tool-x"):
        need("no-such-tool-x")


def test_otlp_without_the_extra_says_how_to_install_it(tmp_path):
    """As on a machine without the `otlp` extra: the SDK cannot be imported."""
    db = tmp_path / "c.duckdb"
    code = ("import sys, runpy; sys.modules['opentelemetry.sdk.metrics'] = None; "
            f"sys.argv = ['collector', '--db', {str(db)!r}, '--otlp', '127.0.0.1:4317']; "
            "runpy.run_module('collector', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "pip install 'tracetop[otlp]'" in out.stderr, out.stderr
    assert not db.exists()
