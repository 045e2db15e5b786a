"""One reference-trainer run for ``tracetop bench hooks``, with the step's CPU time recorded too.

``python -m trainer_hooks._bench_child OUT.json <trainer flags>`` runs ``reference_trainer`` in this
process. The trainer times each step with two ``time.perf_counter()`` calls; this wrapper lets
them through unchanged and notes the process CPU time (every thread: training, the hooks'
emitter and shipper, gloo) at the same two points, then writes the per-step CPU seconds to OUT.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path


def main(argv: list[str]) -> int:
    out, trainer_argv = Path(argv[0]), argv[1:]
    from reference_trainer import train

    marks: list[int] = []
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})

    def perf_counter() -> float:
        marks.append(time.process_time_ns())
        return time.perf_counter()

    clock.perf_counter = perf_counter
    train.time = clock  # only the step timer of train.py reads it
    rc = train.main(trainer_argv)
    out.write_text(json.dumps([(b - a) / 1e9 for a, b in zip(marks[0::2], marks[1::2])]))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
