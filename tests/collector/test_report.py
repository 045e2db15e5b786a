"""`tracetop report`: one self-contained HTML file holding each plot; the grad-sync stand-in checked
against the raw collective rows; alert/action sections when those tables exist; a real headless
Chromium renders it to a screenshot that is not blank (where chromium is installed)."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import duckdb
import pytest

from collector import report as R
from collector.query.post_file import pick_run
from tests.support import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "straggler_run.duckdb"
PLOTTED = ("step-time", "rank-heatmap", "bubble", "collectives", "grad-sync", "memory")


def _report(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetop.cli", "report", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def _sections(text: str) -> dict[str, str]:
    return dict(re.findall(r'<section id="([a-z-]+)">(.*?)</section>', text, flags=re.S))


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "r.html"
    r = _report(FIXTURE, "-o", out)
    assert r.returncode == 0, r.stderr
    # no progress bar without a terminal (stderr may hold matplotlib's one-time font-cache notice)
    assert "\r" not in r.stderr and "[#" not in r.stderr and "/11 " not in r.stderr
    return out


def test_report_holds_each_plot_and_nothing_from_the_network(report: Path) -> None:
    text = report.read_text()
    sections = _sections(text)
    assert set(R.SECTIONS) <= set(sections)
    for sid in PLOTTED:
        assert "<svg" in sections[sid], f"section {sid} has no plot"
    # this run has no offload and took no action: each section says so; its alerts are drawn
    assert "<svg" not in sections["offload"] and "no offload" in sections["offload"]
    assert "<svg" in sections["alerts"] and "straggler" in sections["alerts"]
    assert "<svg" not in sections["actions"]
    assert "nothing was dropped" in sections["gaps"]
    assert "<script" not in text
    assert not re.search(r'(src|href)\s*=\s*"https?:', text)
    assert "@import" not in text and "url(http" not in text


def test_grad_sync_stand_in_matches_the_raw_rows() -> None:
    con = duckdb.connect(str(FIXTURE), read_only=True)
    run_id = pick_run(con, None)
    per = defaultdict(float)
    for step, rank, role, dur in con.execute(
            "SELECT step, rank, role, duration_ns FROM collective WHERE run_id = ?", [run_id]).fetchall():
        if "dp" in role.split("|") and step >= 0:
            per[(step, rank)] += dur / 1e6
    want: dict[int, float] = {}
    for (step, _), ms in per.items():
        want[step] = max(want.get(step, 0.0), ms)
    got = dict(R.grad_sync_by_step_from_dp_collectives(con, run_id))
    assert set(got) == set(want)
    for s in want:
        assert got[s] == pytest.approx(want[s])
    # the injected straggler (rank 3, +150 ms from step 20) makes its DP peer wait in the all-reduce
    before = sorted(got[s] for s in got if 5 <= s < 20)
    after = sorted(got[s] for s in got if s >= 21)
    assert after[len(after) // 2] - before[len(before) // 2] > 150 * 0.5


def test_heatmap_marks_the_straggler_row() -> None:
    con = duckdb.connect(str(FIXTURE), read_only=True)
    hm = R.gather_heatmap(con, pick_run(con, None))
    late = [i for i, s in enumerate(hm["steps"]) if s >= 21]
    med = {r: sorted(hm["grid"][i][j] for j in late)[len(late) // 2] for i, r in enumerate(hm["ranks"])}
    assert max(med, key=med.get) == 3


def test_alerts_and_actions_sections_when_the_tables_exist(tmp_path: Path) -> None:
    """The fixture's own alerts (the live engine's), plus an action added to its actions table; a
    copy without either table says so in both sections."""
    db = tmp_path / "with-actions.duckdb"
    shutil.copy(FIXTURE, db)
    con = duckdb.connect(str(db))
    run_id = pick_run(con, None)
    t0 = con.execute("SELECT min(start_ns) FROM step").fetchone()[0]
    rules = {r for (r,) in con.execute("SELECT DISTINCT rule FROM alerts WHERE run_id = ?", [run_id]).fetchall()}
    con.execute("INSERT INTO actions (action_id, run_id, kind, value, state, step, proposed_ns, done_ns, updated_ns) "
                "VALUES ('1', ?, 'micro_batch', 2, 'applied', 28, ?, ?, ?)", [run_id, t0 + 10**9, t0 + 3 * 10**9, t0 + 3 * 10**9])
    con.close()
    out = tmp_path / "r.html"
    r = _report(db, "-o", out, "--run", run_id)
    assert r.returncode == 0, r.stderr
    sections = _sections(out.read_text())
    assert "straggler" in rules and "<svg" in sections["alerts"] and all(rule in sections["alerts"] for rule in rules)
    assert "<svg" in sections["actions"] and "micro_batch" in sections["actions"]
    bare = tmp_path / "bare.duckdb"
    shutil.copy(FIXTURE, bare)
    con = duckdb.connect(str(bare))
    con.execute("DROP TABLE alerts")
    con.execute("DROP TABLE actions")
    con.close()
    r = _report(bare, "-o", tmp_path / "b.html", "--run", run_id)
    assert r.returncode == 0, r.stderr
    sections = _sections((tmp_path / "b.html").read_text())
    assert "no alerts table" in sections["alerts"] and "no actions table" in sections["actions"]


def test_progress_bar_draws_to_the_end() -> None:
    buf = io.StringIO()
    p = R.Progress(total=3, enabled=True, out=buf)
    for what in ("a", "b", "c"):
        p.step(what)
    assert buf.getvalue().count("\r") == 3 and "3/3" in buf.getvalue() and buf.getvalue().endswith("\n")
    quiet = io.StringIO()
    R.Progress(total=1, enabled=False, out=quiet).step("a")
    assert quiet.getvalue() == ""


def test_bad_arguments(tmp_path: Path) -> None:
    r = _report(tmp_path / "nope.duckdb")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = _report(FIXTURE, "-o", tmp_path / "r.html", "--run", "no-such-run")
    assert r.returncode == 2 and "no-such-run" in r.stderr and not (tmp_path / "r.html").exists()


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium is not installed (apt-get install chromium; kept out of make setup)")
def test_headless_chromium_renders_a_screenshot_that_is_not_blank(report: Path, tmp_path: Path) -> None:
    png = tmp_path / "r.png"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "report_screenshot.sh"), str(report), str(png)],
                       capture_output=True, text=True, timeout=180, env={"PY": sys.executable, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    from PIL import Image

    im = Image.open(png).convert("RGB")
    assert len(im.getcolors(maxcolors=1 << 20) or range(1 << 20)) > 100


def test_lost_section_charges_the_injected_straggler_and_prices_it(tmp_path: Path) -> None:
    """The fixture's run has --inject-straggler 3:150@20: rank 3 tops the table; the cause totals
    are the lost_time text's over the file's rows; the price turns GPU-hours into money."""
    from collector.query.lost_sql import lost_time_sql

    out = tmp_path / "r.html"
    r = _report(FIXTURE, "-o", out, "--price-per-gpu-hour", "2", "--currency", "EUR")
    assert r.returncode == 0, r.stderr
    sec = _sections(out.read_text())["lost"]
    assert "<svg" in sec and "GPU time lost per step, by cause" in sec
    con = duckdb.connect(str(FIXTURE), read_only=True)
    try:
        total_ms = con.execute(f"SELECT sum(lost_gpu_ms) FROM ({lost_time_sql(bounded=True)})",
                               {"run": "fixture-straggler", "lo": 0, "hi": 10**9}).fetchone()[0]
    finally:
        con.close()
    cause_rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>[^<]+</td><td>[^<]+</td><td>([^<]+)</td></tr>", sec)
    allrow = next(r for r in cause_rows if r[0] == "all")
    assert float(allrow[1]) == pytest.approx(total_ms / 3.6e6, rel=1e-3)
    assert float(allrow[2]) == pytest.approx(total_ms / 3.6e6 * 2, rel=1e-2)
    assert "cost (EUR)" in sec
    ranks_table = sec.split("ranks charged the most")[1]
    assert re.search(r"<tbody><tr><td>3</td>", ranks_table)  # the injected straggler first
    bad = _report(FIXTURE, "-o", tmp_path / "bad.html", "--price-per-gpu-hour", "0")
    assert bad.returncode == 2 and "positive number" in bad.stderr and not (tmp_path / "bad.html").exists()


def test_dollar_signs_from_ranks_are_text_not_mathtext(tmp_path: Path) -> None:
    """An op and a role a rank sent with '$…$' in them (mathtext that matplotlib cannot parse): the
    report is still made, and shows them as they were sent. Before: the report aborted."""
    db = tmp_path / "dollars.duckdb"
    shutil.copy(FIXTURE, db)
    con = duckdb.connect(str(db))
    run_id = pick_run(con, None)
    con.execute("UPDATE collective SET op = 'all_reduce$\\bogus{$', role = '$x^$' WHERE op = 'all_reduce'")
    con.close()
    out = tmp_path / "r.html"
    r = _report(db, "-o", out, "--run", run_id)
    assert r.returncode == 0, r.stderr[-2000:]
    sections = _sections(out.read_text())
    assert "<svg" in sections["collectives"] and "all_reduce$\\bogus{$" in sections["collectives"]


def test_incidents_section_names_the_culprit_and_its_consequences(tmp_path: Path) -> None:
    """The fixture's run judged again by the built-in rules into a copy migrated to schema 12: the
    incidents section names the injected straggler (rank 3, cause compute) with the SLA breaches it
    explains; the fixture itself (schema 7) says it predates incidents."""
    from collector.ingest.schema import open_store
    from collector.live.engine import ALERT_COLUMNS, alert_row
    from collector.live.replay import recompute
    from collector.live.rules import defaults

    db = tmp_path / "incidents.duckdb"
    shutil.copy(FIXTURE, db)
    con = open_store(str(db))
    run_id = pick_run(con.cursor(), None)
    found = [a for a in recompute(con, defaults(), runs=[run_id]) if a.state != "pending"]
    con.execute("DELETE FROM alerts")
    con.executemany(f"INSERT INTO alerts VALUES ({', '.join('?' * len(ALERT_COLUMNS))})", [alert_row(a) for a in found])
    cons = sorted(a.rule for a in found if a.is_consequence)
    con.close()
    con = duckdb.connect(str(db), read_only=True)
    try:
        sec = _sections(R.build_report(con, run_id))["incidents"]
    finally:
        con.close()
    assert cons and "1 incident(s)" in sec and f"{len(cons)} alert(s) attached" in sec
    row = re.search(r"<tr><td>firing</td><td>warning</td><td>straggler</td><td>compute</td><td>rank 3, stage 1</td>"
                    r"<td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td>([^<]*)</td>", sec)
    assert row and int(row[3]) == len(cons) and row[4] == ", ".join(sorted(set(cons))), sec[:2000]
    old = duckdb.connect(str(FIXTURE), read_only=True)
    try:
        assert "predates incidents" in _sections(R.build_report(old, run_id))["incidents"]
    finally:
        old.close()
