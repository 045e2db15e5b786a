"""Moved: tests/support/services.py (a shim until every test imports from there)."""

from tests.support import ROOT  # noqa: F401
from tests.support.services import CollectorProc, scrape_metrics, start_collector  # noqa: F401
