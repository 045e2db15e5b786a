"""Helpers for pilot tests: open the app headless on a source, wait for snapshots, read widgets."""

from __future__ import annotations

import asyncio
import io

from rich.console import Console

from tui.app import TracetopApp


async def wait_for(pilot, cond, timeout_s: float = 30.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


def text_of(app: TracetopApp, selector: str, width: int = 200) -> str:
    """The plain text a Static shows (its content rendered by Rich at `width`)."""
    w = app.query_one(selector)
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(w.content)
    return console.export_text()


def table_rows(app: TracetopApp, selector: str) -> list[list[str]]:
    t = app.query_one(selector)
    return [[str(c) for c in t.get_row_at(i)] for i in range(t.row_count)]
