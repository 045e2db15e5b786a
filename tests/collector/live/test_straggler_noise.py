"""The straggler rule on scheduler noise, through the Evaluator with the built-in rules.

A rank descheduled on a busy host computes longer for a step or a few while its peer waits for it:
each such step is that step's straggler (the per-step judgment flags it), but the rule fires only on
`for_steps` (6) consecutive flagged steps: a pending alert is dropped at the first step the rank is
not flagged. The noise is the test's: rank 1 computes 3x (150 vs 50 ms) and waits 10 ms where rank
0 waits 100, in bursts of 1-5 steps (seeded), each followed by at least one clean step; then a
burst of 6."""

from __future__ import annotations

import numpy as np

from collector.live.engine import Evaluator
from collector.live.model import FIRING
from collector.live.rules import defaults
from tests.collector.live.test_engine import _coll_cols, _run_start, _step_cols
from tracetop.events import Kind


def _judge(ev: Evaluator, step: int, slow: bool) -> list:
    compute = np.array([50.0, 150.0 if slow else 50.0])
    wait = np.array([100.0, 10.0]) if slow else np.array([10.0, 10.0])
    ev.ingest(Kind.COLLECTIVE, "noisy", _coll_cols(step, wait), step * 10**9)
    ev.ingest(Kind.STEP, "noisy", _step_cols(step, 2, compute, wait), step * 10**9)
    return [a for a in ev.evaluate_ready((step + 2) * 10**9, 0.0) if a.rule == "straggler"]


def test_bursts_shorter_than_for_steps_never_fire_six_in_a_row_does():
    ev = Evaluator(defaults(), window=64, settle_s=0.0)
    ev.ingest(Kind.RUN_START, "noisy", _run_start(2), 0)
    rng = np.random.default_rng(7)
    slow: list[bool] = []
    while len(slow) < 400:
        slow += [True] * int(rng.integers(1, 6)) + [False] * int(rng.integers(1, 4))
    fired = [a for s, x in enumerate(slow) for a in _judge(ev, s, x) if a.state == FIRING]
    assert sum(slow) > 200 and fired == [], fired  # most steps flagged, never 6 in a row: no alert
    base = len(slow)
    got = [(s, a.state, a.labels["rank"]) for s in range(base, base + 6) for a in _judge(ev, s, True)]
    assert [g for g in got if g[1] == FIRING] == [(base + 5, FIRING, "1")], got
