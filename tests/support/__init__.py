"""What the tests share: real services, torchrun jobs, and one way to wait.

    from tests.support import ROOT
    from tests.support.services import start_collector, start_agent, scrape_metrics
    from tests.support.torchrun import torchrun, launch
    from tests.support.wait import wait_for

``tests/conftest.py`` turns the common cases into fixtures: ``collector`` (a running collector on a
fresh file), ``recorded_file`` (a copy of the recorded reference run) and ``torchrun_job``.
Helpers that belong to one package's tests stay beside them (``tests/collector/util.py``'s raw
ingest client, ``tests/tui/pilot.py``'s headless app helpers).
"""

from __future__ import annotations

from pathlib import Path

#: the checkout's root (the processes the tests start run there)
ROOT = Path(__file__).resolve().parents[2]
#: small real inputs committed with the tests, and the script that made them (scripts/make_fixture.py)
FIXTURES = ROOT / "tests" / "fixtures"
