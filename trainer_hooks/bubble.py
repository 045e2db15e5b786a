"""Pipeline bubble rate (DESIGN §3), pure functions.

bubble = 1 - (time in forward + backward compute) / (wall time of the pipeline schedule)

Per rank and step the hooks record ``forward_ns`` and ``backward_ns`` (self time of the
ForwardPass / BackwardPass instructions, collective waits inside them excluded) and the step's
``duration_ns`` (the whole ``train_batch``: the schedule, including its reduce and optimizer
instructions, which every stage runs after the pipeline drains). Stages are synchronised at each
step's end, so every stage sees the same wall time and the idle share is its bubble. The
reduce/optimizer tail only adds to the bubble, so a balanced 1F1B pipeline gives at least
(p-1)/(m+p-1).
"""

from __future__ import annotations

import math


def expected_bubble_rate(stages: int, micro_batches: int) -> float:
    """The ideal 1F1B/GPipe bubble for balanced stages: (p-1)/(m+p-1)."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages={stages}, micro_batches={micro_batches}: both must be at least 1")
    return (stages - 1) / (micro_batches + stages - 1)


def bubble_rate(forward_ns: float, backward_ns: float, schedule_ns: float) -> float:
    """1 - (forward + backward) / schedule wall time; NaN when the wall time is not positive.
    Clamped to [0, 1] (clock granularity can make compute exceed wall time by a hair)."""
    if not schedule_ns > 0:
        return math.nan
    return min(1.0, max(0.0, 1.0 - (forward_ns + backward_ns) / schedule_ns))

# The collector's `bubble_by_stage` view (collector/ingest/schema.py) applies the same definition in SQL.
