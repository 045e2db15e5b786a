"""The plain DDP loop of the first-failure and never-heard tests: collector/bench/judge_loop.py
(`tracetop bench judge` runs the same loop), as a script for torchrun:

    torchrun --standalone --nproc_per_node 4 tests/collector/live/failure_loop.py --steps 40 --kill 3@20

Its options (--kill, --late, --die-early, --slow-data, --fault KIND:RANK:X@STEP, --step-ms,
--timeout-s, --pid-dir) are documented there.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from collector.bench.judge_loop import main  # noqa: E402

if __name__ == "__main__":
    main()
