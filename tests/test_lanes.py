"""`make test`'s two workers: a module marked ``alone`` shares the machine with no other ``slow``
module (tests/conftest.py ``_multi_process_lane``). Three modules under a real ``pytest -n 2``, each
holding its worker 2 s and writing when it ran: the ``alone`` one overlaps neither ``slow`` one."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import ROOT

MODULE = '''import time, pytest
pytestmark = {marks}
def test_hold():
    t0 = time.monotonic(); time.sleep(2)
    open({out!r}, "w").write(f"{{t0}} {{time.monotonic()}}")
'''


def test_an_alone_module_runs_beside_no_other_multi_process_module(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.conftest import _multi_process_lane  # noqa: F401\n")
    marks = {"a": "[pytest.mark.slow]", "b": "[pytest.mark.slow, pytest.mark.alone]", "c": "[pytest.mark.slow]"}
    for name, m in marks.items():
        (suite / f"test_{name}.py").write_text(MODULE.format(marks=m, out=str(tmp_path / f"{name}.txt")))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                        "--rootdir", str(suite), str(suite)], cwd=suite, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    spans = {n: tuple(map(float, (tmp_path / f"{n}.txt").read_text().split())) for n in marks}
    (b0, b1) = spans["b"]
    for n in ("a", "c"):
        s0, s1 = spans[n]
        assert s1 <= b0 or s0 >= b1, (n, spans)  # no overlap with the alone module
