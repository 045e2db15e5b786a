"""The controller's pure policies on hand-made inputs (no processes)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from collector.control import policy
from collector.control.controller import SettingsError, settings_from_table
from collector.control.policy import ControlInputs, Memory, RankMemory, Settings
from collector.live.model import Alert

GIB = 2**30
S = Settings()


def inputs(share: float = 0.5, *, mb: int = 4, mbs: int = 4, pp: int = 1, zero: int = 1, offload: bool = False,
           bubble: tuple[float, ...] = (), sps: float = 100.0, opt_ms: float = 10.0, alerts=(), step: int = 100,
           ranks: int = 2) -> ControlInputs:
    mem = tuple(RankMemory(r, int(share * 8 * GIB) if r == ranks - 1 else int(0.1 * 8 * GIB), 8 * GIB) for r in range(ranks))
    return ControlInputs("r1", step, ranks, ranks // pp, pp, zero, mb, mbs, offload, mem, bubble, 0.3, sps, opt_ms,
                         tuple(alerts))


def test_memory_above_budget_shrinks_the_micro_batch_keeping_the_samples():
    d, mem = policy.decide(inputs(0.95), Memory(), S)
    assert (d.outcome, d.kind, d.value, d.rule) == ("act", "micro_batch", 2, "memory")
    assert "rank 1" in d.reason and "95%" in d.reason and "keeps 16 samples" in d.reason
    assert mem.too_big == 4  # never grown back to 4


def test_at_the_smallest_micro_batch_offload_then_cannot_fix():
    d, _ = policy.decide(inputs(0.95, mb=1, mbs=16, zero=1), Memory(), S)
    assert (d.outcome, d.kind, d.value) == ("act", "offload", 1)
    d, mem = policy.decide(inputs(0.95, mb=1, mbs=16, zero=0), Memory(), S)
    assert d.outcome == "cannot_fix" and "ZeRO 0" in d.reason and "memory" in mem.gave_up
    d, _ = policy.decide(inputs(0.95, mb=2, mbs=8), Memory(), dataclasses.replace(S, min_micro_batch=2, max_actions_per_problem=5))
    assert (d.kind, d.value) == ("offload", 1)  # the bound on the micro-batch is kept


def test_a_leak_gets_at_most_the_configured_actions_then_one_cannot_fix():
    """Memory grows every step whatever is done (the leak): each decision is applied to the
    simulated run; after max_actions_per_problem changes, one cannot_fix, then only holds."""
    s = dataclasses.replace(S, max_actions_per_problem=2)
    mem, mb, offload, share = Memory(), 4, False, 0.85
    acts, cannot, shapes = [], 0, []
    for step in range(200):
        share += 0.01  # the leak: no change of batch shape moves it
        d, mem = policy.decide(inputs(share, mb=mb, mbs=16 // mb, offload=offload, step=step), mem, s)
        if d.outcome == "act":
            acts.append((d.kind, d.value))
            mem = mem.counted(d.problem)
            if d.kind == "micro_batch":
                mb = d.value
            else:
                offload = bool(d.value)
        elif d.outcome == "cannot_fix":
            cannot += 1
        shapes.append(mb)
    assert len(acts) == 2 and cannot == 1, (acts, cannot)
    assert acts == [("micro_batch", 2), ("micro_batch", 1)]
    assert shapes == sorted(shapes, reverse=True)  # never back up: no oscillation


def test_no_oscillation_memory_then_headroom_does_not_grow_back():
    d, mem = policy.decide(inputs(0.95, mb=4, mbs=4), Memory(best_samples_per_s=200, best_micro_batch=4), S)
    assert d.value == 2
    mem = mem.counted("memory")
    d, mem = policy.decide(inputs(0.30, mb=2, mbs=8, sps=100), mem, S)  # memory fell, throughput below the best
    assert d.outcome == "hold", d  # 4 was too big: grow never returns to it


def test_bubble_with_headroom_adds_micro_batches():
    d, _ = policy.decide(inputs(0.5, mb=8, mbs=2, pp=2, bubble=(0.45, 0.40)), Memory(), S)
    assert (d.outcome, d.kind, d.value, d.rule) == ("act", "micro_batch", 4, "bubble")
    assert "45%" in d.reason and "4 micro-batches" in d.reason
    assert "(p-1)/(m+p-1) = 20%" in d.expected and "from 33%" in d.expected
    d, _ = policy.decide(inputs(0.8, mb=8, mbs=2, pp=2, bubble=(0.45,)), Memory(), S)
    assert d.outcome == "hold"  # no memory headroom: a bubble alone does not move the batch
    d, _ = policy.decide(inputs(0.5, mb=8, mbs=2, pp=2, bubble=(0.2,)), Memory(), S)
    assert d.outcome == "hold"  # under the rule's threshold


def test_grow_tries_larger_and_never_a_size_that_did_not_pay():
    mem = Memory(best_samples_per_s=150.0, best_micro_batch=2)
    d, _ = policy.decide(inputs(0.3, mb=2, mbs=8, sps=100.0), mem, S)
    assert (d.outcome, d.kind, d.value, d.rule) == ("act", "micro_batch", 4, "grow")
    d, _ = policy.decide(inputs(0.3, mb=2, mbs=8, sps=100.0), dataclasses.replace(mem, no_gain=frozenset({4})), S)
    assert (d.kind, d.value) == ("micro_batch", 8)
    d, _ = policy.decide(inputs(0.3, mb=2, mbs=8, sps=100.0), dataclasses.replace(mem, no_gain=frozenset({4, 8, 16})), S)
    assert d.outcome == "hold"
    d, _ = policy.decide(inputs(0.3, mb=2, mbs=8, sps=149.0), mem, S)
    assert d.outcome == "hold"  # within min_throughput_gain of the best


def test_offload_off_when_memory_is_far_below_and_the_optimizer_slowed():
    mem = Memory(optimizer_ms_before_offload=10.0)
    d, _ = policy.decide(inputs(0.3, offload=True, opt_ms=15.0, sps=100), mem, S)
    assert (d.outcome, d.kind, d.value, d.rule) == ("act", "offload", 0, "offload_off")
    d, _ = policy.decide(inputs(0.3, offload=True, opt_ms=11.0, sps=100), mem, S)
    assert d.outcome == "hold"  # 10 % slower is under the 20 % the copies must cost
    d, _ = policy.decide(inputs(0.7, offload=True, opt_ms=15.0, sps=100), mem, S)
    assert d.outcome == "hold"  # memory not far enough below


def _alert(rule: str) -> Alert:
    return Alert(rule, rule, "warning", "firing", "r1", "rank", {"rank": "1"}, 1, 2, 0, 0, 3.0, 2.0,
                 f"rank 1 is a {rule}")


def test_gate_alerts_cooldown_cap_and_in_flight():
    base = dict(now_s=1000.0, last_change_s=0.0, last_change_step=0, changes_last_hour=0)
    assert policy.gate(inputs(0.95, step=100), S, **base) is None
    why = policy.gate(inputs(0.95, alerts=[_alert("straggler")]), S, **base)
    assert why and "straggler" in why and "rank 1 is a straggler" in why
    assert policy.gate(inputs(0.95, alerts=[_alert("hang")]), S, **base)
    assert policy.gate(inputs(0.95, alerts=[_alert("grad_sync_ms")]), S, **base) is None
    assert "cooling down" in policy.gate(inputs(0.95), S, **{**base, "last_change_s": 990.0})
    assert "cooling down" in policy.gate(inputs(0.95, step=100), S, **{**base, "last_change_step": 95})
    assert "cap" in policy.gate(inputs(0.95), S, **{**base, "changes_last_hour": 6})
    assert "in flight" in policy.gate(inputs(0.95), S, **base, open_action="7")


def test_verify_keeps_or_rolls_back():
    v = policy.verify(100.0, 85.0, "memory", S, 0.95, 0.6)
    assert not v.keep and "-15%" in v.text and "95% -> 60%" in v.text
    assert policy.verify(100.0, 95.0, "memory", S).keep
    assert not policy.verify(100.0, 101.0, "grow", S).keep  # a larger micro-batch must gain 2 %
    assert policy.verify(100.0, 110.0, "grow", S).keep
    assert policy.verify(math.nan, 110.0, "grow", S).keep


def test_settings_from_the_toml_table():
    c = settings_from_table({"mode": "auto", "memory_high": 0.8, "verify_steps": 5}, mode=None)
    assert c.mode == "auto" and c.policy.memory_high == 0.8 and c.policy.verify_steps == 5
    assert settings_from_table({"mode": "auto"}, mode="advise").mode == "advise"  # the flag wins
    assert settings_from_table({}).mode == "advise"  # the default
    with pytest.raises(SettingsError, match="did you mean 'memory_high'"):
        settings_from_table({"memory_hihg": 0.8})
    with pytest.raises(SettingsError, match="mode"):
        settings_from_table({"mode": "yes"})


def test_a_size_rolled_back_is_not_tried_again_by_memory():
    mem = Memory(no_gain=frozenset({2}))
    d, _ = policy.decide(inputs(0.95, mb=4, mbs=4), mem, S)
    assert (d.kind, d.value) == ("micro_batch", 1)


def test_gate_holds_while_an_applied_change_awaits_verification():
    base = dict(now_s=1000.0, last_change_s=0.0, last_change_step=0, changes_last_hour=0)
    why = policy.gate(inputs(0.95), S, **base, unverified="4")
    assert why and "action 4 is applied and not yet verified" in why
    assert policy.gate(inputs(0.95), S, **base, unverified="") is None
