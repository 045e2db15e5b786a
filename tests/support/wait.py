"""One way to wait for a condition in a test: poll, return what came, or fail saying what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout_s: float = 30.0, what: str = "condition",
             show: Callable[[], Any] | None = None, *, every_s: float = 0.05) -> T:
    """Call ``pred`` every ``every_s`` until it returns something truthy, and return that. After
    ``timeout_s`` fail with what was awaited (and ``show()``, the last state worth seeing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            last = f"; last: {show()}" if show is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{last}")
        time.sleep(every_s)
