"""Suite-wide setup.

`tracemalloc` is imported here, before any test starts threads: pytest's unraisable-exception hook
imports it lazily, and when several gRPC threads report unraisable objects at once (channels torn
down after a TLS handshake failure), the second sees a partially initialised module and the hook
itself crashes, failing an unrelated test (seen in tests/collector/test_auth.py).
"""

import fcntl  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tracemalloc  # noqa: F401
from collections.abc import Callable, Iterator  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

# hypothesis' pytest plugin imports hypothesis at the end of a session that collected no
# hypothesis test; on CPython 3.11.7 that import, deep in pytest's summary hooks, can fail with
# "SystemError: AST constructor recursion depth mismatch" (assertion rewriting compiles it there)
# and turn a green run into exit 1. Importing it up front avoids the deep-stack compile.
import hypothesis  # noqa: E402, F401
import pytest  # noqa: E402

from tests.support import FIXTURES  # noqa: E402
from tests.support.services import CollectorProc, start_collector  # noqa: E402
from tests.support.torchrun import RunResult, torchrun  # noqa: E402


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProc]:
    """A real collector (its own process) on a fresh file in tmp_path, on a loopback port it picked;
    stopped by SIGTERM after the test, which must find it exiting cleanly. Modules that need other
    flags or one collector for all their tests define their own ``collector`` fixture."""
    c = start_collector(tmp_path)
    yield c
    assert c.stop() == 0, c.text()


@pytest.fixture
def recorded_file(tmp_path: Path) -> Path:
    """A copy of the recorded reference run (tests/fixtures/straggler_run.duckdb: 4 ranks, a
    straggler; made by scripts/make_fixture.py), free to open, migrate or write."""
    dst = tmp_path / "recorded.duckdb"
    shutil.copyfile(FIXTURES / "straggler_run.duckdb", dst)
    return dst


@pytest.fixture
def torchrun_job(tmp_path: Path) -> Callable[..., RunResult]:
    """``torchrun_job(nproc=2, args=[...])``: the reference trainer under torchrun, logs in tmp_path."""
    return partial(torchrun, tmp_path / "job")


@pytest.fixture(scope="module", autouse=True)
def _multi_process_lane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under `make test`'s two workers: a module marked ``alone`` runs while no other ``slow``
    (multi-process) module does; ``slow`` modules share the machine with one another. A shared file
    lock in the workers' common temp directory, held for the module; without workers, nothing.

    ``alone`` is for a test whose ground truth is a wall-clock effect of its own processes sharing
    the cores, which another multi-process job beside it erases, not merely blurs (the bubble's
    fall, tests/collector/control/test_bubble_and_leak.py; a clean run's "no rank is slow",
    tests/collector/live/test_live_false_alarms.py, the demo's one straggler, tests/test_demo.py). Load from single-process tests and
    other noise stays: such a test must still hold at load 4. tests/test_lanes.py checks it."""
    names = {m.name for m in request.node.iter_markers()}
    if "PYTEST_XDIST_WORKER" not in os.environ or not names & {"slow", "alone"}:
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "multi-process.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if "alone" in names else fcntl.LOCK_SH)
        yield  # closing the file lets the lock go
