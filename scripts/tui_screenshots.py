"""Export docs/tui.md's TUI screenshots (SVG) from the committed fixture.

    .venv/bin/python scripts/tui_screenshots.py            # writes tui/screenshots/*.svg
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHOTS = [("overview", ["1"]), ("ranks", ["2"]), ("rank-detail", ["2"]), ("pipeline", ["3"]),
         ("collectives", ["4"]), ("offload", ["5"]), ("gpus", ["6"]), ("alerts", ["7"]), ("help", ["question_mark"])]


async def shoot(name: str, keys: list[str], out: Path) -> None:
    from tui.app import TracetopApp
    from tui.sources import FileSource

    app = TracetopApp(FileSource(ROOT / "tests" / "fixtures" / "straggler_run.duckdb"))
    async with app.run_test(size=(130, 42)) as pilot:
        while app.snap is None:
            await pilot.pause(0.05)
        for k in keys:
            await pilot.press(k)
        if name == "rank-detail":
            app.drill(("rank", int(app.query_one("#ranks-side").get_row_at(0)[0])))
            while app.detail is None:
                await pilot.pause(0.05)
        await pilot.pause(0.2)
        app.save_screenshot(filename=f"{name}.svg", path=str(out))


def main() -> int:
    out = ROOT / "tui" / "screenshots"
    out.mkdir(exist_ok=True)
    for name, keys in SHOTS:
        asyncio.run(shoot(name, keys, out))
        print(f"tui_screenshots: {out / (name + '.svg')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
