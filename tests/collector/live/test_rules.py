"""Rules files: the built-in set passes; each kind of bad file is refused naming file, line, key
and the fix, by `tracetop rules check` (exit 2) and by the collector before it listens (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from collector.live.rules import DEFAULTS_TOML, SIGNALS, RulesError, defaults, load, parse
from tests.support import ROOT

GOOD = """\
[rule.gs]
signal = "grad_sync"
grad_sync_ms_above = 200
for_steps = 3
clear_below = 150
severity = "critical"
labels = { team = "infra" }
"""

# (file text, line, key, words the message must hold)
BAD = {
    "unknown key": (GOOD + "threshhold_ms = 200\n", 8, "threshhold_ms", "unknown key"),
    "nearest key": (GOOD.replace("for_steps", "for_step"), 4, "for_step", "did you mean 'for_steps'"),
    "unknown signal": (GOOD.replace('"grad_sync"', '"grad_synk"'), 2, "signal", "did you mean 'grad_sync'"),
    "wrong unit": (GOOD.replace("grad_sync_ms_above = 200", "grad_sync_s_above = 0.2"), 3, "grad_sync_s_above",
                   "grad_sync_ms_above"),
    "wrong type": (GOOD.replace("= 200", '= "200ms"'), 3, "grad_sync_ms_above", "must be a number"),
    "out of range": (GOOD.replace("grad_sync_ms_above = 200", "grad_sync_ms_above = -5"), 3, "grad_sync_ms_above",
                     "out of range"),
    "share above 1": ('[rule.c]\nsignal = "comm_share"\ncomm_share_above = 30\n', 3, "comm_share_above", "<= 1"),
    "non-positive hold": (GOOD.replace("for_steps = 3", "for_steps = 0"), 4, "for_steps", "positive"),
    "non-positive for_s": ('[rule.s]\nsignal = "silent_rank"\nsilent_s_above = 15\nfor_s = -1\n', 4, "for_s", "positive"),
    "negative resolve hold": (GOOD + "keep_firing_steps = -1\n", 8, "keep_firing_steps", "0 or"),
    "resolve hold in the wrong unit": ('[rule.s]\nsignal = "silent_rank"\nsilent_s_above = 15\nkeep_firing_steps = 3\n',
                                       4, "keep_firing_steps", "keep_firing_s"),
    "bad scope": (GOOD + 'scope = "rank"\n', 8, "scope", "not per rank"),
    "bad severity": (GOOD.replace('"critical"', '"urgent"'), 6, "severity", "not a severity"),
    "hysteresis wrong side": (GOOD.replace("clear_below = 150", "clear_below = 250"), 5, "clear_below", "wrong side"),
    "malformed TOML": (GOOD.replace("for_steps = 3", "for_steps = = 3"), 4, "", "malformed TOML"),
}


def test_defaults_parse_and_cover_the_sla_table():
    rules = defaults()
    by = {r.name: r for r in rules}
    assert by["bubble_warn"].threshold == 0.15 and by["bubble_critical"].threshold == 0.30
    assert by["bubble_warn"].params["imbalance_above"] == 1.2
    assert by["grad_sync"].threshold == 200 and by["comm_share"].threshold == 0.30
    assert by["scaling_efficiency"].threshold == 0.75 and by["memory"].threshold == 0.90
    assert by["offload_bandwidth"].threshold == 5 and by["silent_rank"].threshold == 15
    assert by["stuck_collective"].threshold == 15 and by["loss_spike"].threshold == 0.15
    assert by["thermal_throttle"].for_s == 30 and by["xid"].threshold == 0
    assert not by["throughput_per_gpu"].enabled
    assert {r.signal for r in rules} == set(SIGNALS)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_refused_with_line_and_key(case, tmp_path):
    text, line, key, words = BAD[case]
    path = tmp_path / "rules.toml"
    path.write_text(text)
    with pytest.raises(RulesError) as e:
        load(str(path))
    msg = str(e.value)
    assert f"{path}:{line}:" in msg, msg
    assert key in msg and words in msg, msg


def test_good_file_and_hysteresis():
    (r,) = parse(GOOD)
    assert (r.signal, r.threshold, r.for_steps, r.clear, r.severity, dict(r.labels)) == \
        ("grad_sync", 200, 3, 150, "critical", {"team": "infra"})
    assert r.breached(201) and not r.breached(200) and not r.breached(float("nan"))
    assert not r.cleared(180) and r.cleared(149)  # between clear_below and the threshold: still firing


def test_every_fault_is_reported_at_once():
    text = GOOD.replace("for_steps = 3", "for_steps = 0") + "bogus_key = 1\n"
    with pytest.raises(RulesError) as e:
        parse(text, "f.toml")
    assert len(e.value.faults) == 2


def _tt(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_check_defaults_and_collector_refuses_before_listening(tmp_path):
    d = _tt("rules", "defaults")
    assert d.returncode == 0 and d.stdout == DEFAULTS_TOML
    good = tmp_path / "good.toml"
    good.write_text(d.stdout)
    ok = _tt("rules", "check", str(good))
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(d.stdout.replace("stuck_s_above = 15", "stuck_s_above = 0"))
    line = next(i for i, t in enumerate(bad.read_text().splitlines(), 1) if t.startswith("stuck_s_above"))
    r = _tt("rules", "check", str(bad))
    assert r.returncode == 2 and f"{bad}:{line}: stuck_s_above" in r.stderr, r.stderr
    db = tmp_path / "x.duckdb"
    col = _tt("collector", "--db", str(db), "--listen", f"unix://{tmp_path / 'c.sock'}", "--rules", str(bad))
    assert col.returncode == 2 and "listening" not in col.stdout and f"{bad}:{line}" in col.stderr
    assert not db.exists()  # nothing started, nothing written
    missing = _tt("rules", "check", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
