"""The controller's thin loop: inputs from a callable, the pure policies (policy.py), actions
through the Control service. Modes: ``off``, ``advise`` (the default: proposals a person
approves with `tracetop control approve ID`), ``auto`` (approved by the controller itself).

Each tick (``tick_s``), per run the inputs source reports:
1. verify: an applied action ``verify_steps`` steps old is kept (``verified``) or rolled back on
   every rank (``policy.verify``: throughput fell more than ``max_throughput_drop``, or a larger
   micro-batch did not gain ``min_throughput_gain``), compared over the steps before and after it;
   A tick that rolls back proposes nothing else; a rollback is verified but never rolled back;
2. gate: no change while a hang or straggler alert fires, while an action is in flight, during
   while an applied change (not a rollback) awaits its verification, during
   the cooldown, beyond the hourly cap. The cooldown (``cooldown_s`` and ``cooldown_steps``)
   counts from the last change *applied* on the ranks (its step, its time), so after a rollback
   the problem is judged again only on steps run with the rolled-back shape;
2a. rebalance (rebalance.py): before the gate's alert hold (the straggler alert is its trigger),
   under the rest of the gate; a rebalance is verified on the step time and the loss, rolled back
   when it did not pay (that replica is not relieved again), undone when the replica recovers;
3. decide: at most one proposal; a problem given up on is reported once as "cannot fix" (an
   Alert to the sink, and a `cannot_fix` row in `actions`).
Every decision is kept with its reason (``decisions``, the newest 200).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

from collector.control import policy
from collector.control import rebalance as rebalance_policy
from collector.control.actions import OPEN
from collector.control.policy import ControlInputs, Memory, Settings
from collector.live.model import FIRING, Alert
from tracetop.errors import TracetopError

log = logging.getLogger("tracetop.collector")

MODES = ("off", "advise", "auto")
#: the kinds the controller verifies and counts as changes (its cooldown, its one-at-a-time)
CHANGES = ("micro_batch", "offload", "rebalance")


class SettingsError(TracetopError, ValueError):
    """A bad [controller] table or flag; the message names the key and the fix."""


@dataclass(frozen=True)
class ControllerSettings:
    mode: str = "advise"
    tick_s: float = 2.0
    policy: Settings = Settings()


def settings_from_table(table: dict[str, Any], *, mode: str | None = None) -> ControllerSettings:
    """The TOML's [controller] table: ``mode``, ``tick_s`` and every field of ``policy.Settings``
    (units in the keys: ``cooldown_s``, ``verify_steps``, shares as 0..1). The flag's mode wins."""
    known = {f.name: f for f in fields(Settings)}
    top = {"mode", "tick_s"}
    pol: dict[str, Any] = {}
    for key, value in table.items():
        if key in top:
            continue
        if key not in known:
            near = difflib.get_close_matches(key, list(known) + list(top), n=1)
            raise SettingsError(f"[controller] {key!r} is not a setting" + (f"; did you mean {near[0]!r}?" if near else ""))
        want = int if known[key].type in ("int", int) else float
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SettingsError(f"[controller] {key} = {value!r}: give a number")
        pol[key] = want(value)
    m = mode or table.get("mode", "advise")
    if m not in MODES:
        raise SettingsError(f"[controller] mode = {m!r}: use one of {', '.join(MODES)}")
    tick = float(table.get("tick_s", 2.0))
    if tick <= 0:
        raise SettingsError(f"[controller] tick_s = {tick}: give a positive number of seconds")
    return ControllerSettings(mode=m, tick_s=tick, policy=Settings(**pol))


def load_settings(path: str | None, *, mode: str | None = None) -> ControllerSettings:
    table: dict[str, Any] = {}
    if path:
        import tomllib

        try:
            with open(path, "rb") as f:
                table = tomllib.load(f).get("controller", {}) or {}
        except OSError as e:
            raise SettingsError(f"--controller-config {path}: {e.strerror}") from e
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"--controller-config {path}: not valid TOML: {e}") from e
    return settings_from_table(table, mode=mode)


class InputsSource(Protocol):
    """Where the controller's inputs come from: live_inputs.EngineInputs (the live engine's state,
    where it runs) or inputs.RowInputs (the committed rows, where it is off)."""

    def read(self) -> list[ControlInputs]: ...

    def samples_per_s(self, run_id: str, first_step: int, last_step: int) -> float: ...

    def memory_share(self, run_id: str, first_step: int, last_step: int) -> float: ...

    def step_ms(self, run_id: str, first_step: int, last_step: int) -> float: ...

    def loss(self, run_id: str, first_step: int, last_step: int) -> float: ...


@dataclass(frozen=True)
class Logged:
    run_id: str
    step: int
    outcome: str  # act | hold | cannot_fix | verified | rolled_back | proposed
    reason: str


class Controller:
    def __init__(self, service: Any, source: InputsSource, settings: ControllerSettings, *,
                 clock_s: Callable[[], float] = time.time, alert_sink: Any = None) -> None:
        self.service = service
        self.source = source
        self.settings = settings
        self.clock_s = clock_s
        self.alert_sink = alert_sink
        self.memory: dict[str, Memory] = {}
        self.decisions: collections.deque[Logged] = collections.deque(maxlen=200)
        self.changes: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)  # run -> (time, step)
        self._latest: list[ControlInputs] = []
        self._last_hold: dict[str, str] = {}

    def gather(self) -> None:
        """The inputs (called off the event loop: the source runs SQL)."""
        self._latest = self.source.read()
        self._windows = {}
        for inp in self._latest:
            for a in self._to_verify(inp):
                k = self.settings.policy.verify_steps
                if a.kind == "rebalance":  # step time and loss, before and after
                    self._windows[a.action_id] = (
                        self.source.step_ms(inp.run_id, a.step - k, a.step - 1),
                        self.source.step_ms(inp.run_id, a.step + 1, a.step + k),
                        self.source.loss(inp.run_id, a.step - k, a.step - 1),
                        self.source.loss(inp.run_id, a.step + 1, a.step + k))
                    continue
                self._windows[a.action_id] = (
                    self.source.samples_per_s(inp.run_id, a.step - k, a.step - 1),
                    self.source.samples_per_s(inp.run_id, a.step + 1, a.step + k),
                    self.source.memory_share(inp.run_id, a.step - k, a.step - 1),
                    self.source.memory_share(inp.run_id, a.step + 1, a.step + k))

    def _to_verify(self, inp: ControlInputs) -> list[Any]:
        """Applied actions ``verify_steps`` old, but not one a rollback was already sent for (on
        its way, or failed: a failed rollback is left to a person, not retried every tick)."""
        k = self.settings.policy.verify_steps
        acts = list(self.service.actions.values())
        undoing = {a.rollback_of for a in acts if a.rollback_of}
        return [a for a in acts
                if a.run_id == inp.run_id and a.state == "applied" and a.step is not None and a.step >= 0
                and inp.step >= a.step + k and a.kind in CHANGES and a.action_id not in undoing]

    def _last_change(self, run: str, recent: list[tuple[float, int]]) -> tuple[float, int]:
        """(time, step) the cooldown counts from: the latest of the controller's own proposals and
        of any change applied on the ranks (a rollback, a person's), at the step it took effect."""
        last_t, last_step = recent[-1] if recent else (-math.inf, -(10**9))
        for a in self.service.actions.values():
            if (a.run_id == run and a.kind in CHANGES and a.step is not None and a.step >= 0
                    and a.done_ns and a.state in ("applied", "verified", "rolled_back")):
                last_t, last_step = max(last_t, a.done_ns / 1e9), max(last_step, a.step)
        return last_t, last_step

    def decide_and_act(self) -> None:
        if self.settings.mode == "off":
            return
        for inp in self._latest:
            try:
                self.tick(inp)
            except Exception:
                log.exception("collector: controller failed on run %s", inp.run_id)

    def tick(self, inp: ControlInputs) -> None:
        s = self.settings.policy
        run = inp.run_id
        mem = self.memory.get(run, Memory())
        if inp.samples_per_s > mem.best_samples_per_s:
            mem = dataclasses.replace(mem, best_samples_per_s=inp.samples_per_s, best_micro_batch=inp.micro_batch)
        # 1. verify what was applied
        rolled = False
        for a in self._to_verify(inp):
            before, after, m0, m1 = getattr(self, "_windows", {}).get(a.action_id, (math.nan,) * 4)
            if a.kind == "rebalance":
                v = rebalance_policy.verify(before, after, m0, m1, undo=a.value < 0 or bool(a.rollback_of), s=s)
            else:
                v = policy.verify(before, after, a.rule, s, m0, m1)
            if not v.keep and (a.proposed_by != "controller" or a.rollback_of):  # said, not undone
                who = "a rollback restores the shape before it" if a.rollback_of else "a person's change"
                v = policy.Verdict(True, f"{v.text.replace('rolled back: ', 'not verified: ', 1)} "
                                   f"({who}: the controller does not roll it back)")
            if v.keep:
                self.service.verified(a.action_id, v.text)
                self._log(run, inp.step, "verified", f"action {a.action_id}: {v.text}")
            else:
                if a.kind == "rebalance":
                    mem = dataclasses.replace(mem, unhelped=mem.unhelped | {a.value})
                elif a.rule == "grow" or a.kind == "micro_batch":
                    mem = dataclasses.replace(mem, no_gain=mem.no_gain | {a.value})
                a.verification = v.text
                self.service.rollback(a.action_id, by="controller", reason=v.text, rule="verify")
                self.changes[run].append((self.clock_s(), inp.step))
                self._log(run, inp.step, "rolled_back", f"action {a.action_id}: {v.text}")
                rolled = True
        if rolled:  # nothing else this tick: the problem is judged again once the rollback is in force
            self.memory[run] = mem
            return
        # 2. gate
        now = self.clock_s()
        recent = [c for c in self.changes[run] if now - c[0] < 3600]
        last_t, last_step = self._last_change(run, recent)
        open_action = next((a.action_id for a in self.service.actions.values()
                            if a.run_id == run and a.state in OPEN), "")
        unverified = next((a.action_id for a in self.service.actions.values()
                           if a.run_id == run and a.state == "applied" and not a.rollback_of
                           and a.kind in CHANGES), "")
        # 2a. rebalance: its trigger is the straggler alert that holds every other policy
        why = policy.gate(dataclasses.replace(inp, alerts=tuple(a for a in inp.alerts if a.signal != "straggler")), s,
                          now_s=now, last_change_s=last_t, last_change_step=last_step, changes_last_hour=len(recent),
                          open_action=open_action, unverified=unverified)
        shape = self.service.shape(run)
        d_rb = None if why or shape is None else rebalance_policy.decide(inp, shape.rebalance, shape.relieved, s)
        if d_rb is not None and d_rb.outcome == "act" and d_rb.rule == rebalance_policy.RULE and d_rb.value in mem.unhelped:
            d_rb = policy.Decision("hold", d_rb.rule, f"replica {d_rb.value} is a straggler again, but relieving it "
                                   "did not pay before (rolled back); not tried again")
        if d_rb is not None and d_rb.outcome == "act":
            self._propose(inp, d_rb, mem, now)
            return
        if d_rb is not None and shape is not None and not shape.rebalance:  # a straggler fires: every other policy holds on it
            self.memory[run] = mem
            self._hold(run, inp.step, d_rb.reason)
            return
        why = policy.gate(inp, s, now_s=now, last_change_s=last_t, last_change_step=last_step,
                          changes_last_hour=len(recent), open_action=open_action, unverified=unverified)
        if why:
            self.memory[run] = mem
            self._hold(run, inp.step, why)
            return
        # 3. decide
        d, mem = policy.decide(inp, mem, s)
        if d.outcome == "act":
            if d.kind == "offload" and d.value:
                mem = dataclasses.replace(mem, optimizer_ms_before_offload=inp.optimizer_ms)
            self._propose(inp, d, mem, now)
            return
        if d.outcome == "cannot_fix":
            self._cannot_fix(inp, d)
        else:
            self._hold(run, inp.step, d.reason)
        self.memory[run] = mem

    def _propose(self, inp: ControlInputs, d: policy.Decision, mem: Memory, now: float) -> None:
        run = inp.run_id
        try:
            a = self.service.propose(run, d.kind, d.value, by="controller", rule=d.rule, reason=d.reason,
                                     expected=d.expected, approve=self.settings.mode == "auto", values=d.values)
        except Exception as e:  # refused (the run changed meanwhile): a hold with the reason
            self._hold(run, inp.step, f"proposal refused: {e}")
        else:
            mem = mem.counted(d.problem)
            self.changes[run].append((now, inp.step))
            self._log(run, inp.step, "proposed" if self.settings.mode == "advise" else "act",
                      f"action {a.action_id}: {d.reason}")
        self.memory[run] = mem

    def _cannot_fix(self, inp: ControlInputs, d: policy.Decision) -> None:
        self._log(inp.run_id, inp.step, "cannot_fix", d.reason)
        self.service.record_cannot_fix(inp.run_id, d.problem, d.reason)
        if self.alert_sink is not None:
            now = int(self.clock_s() * 1e9)
            share, who = inp.memory_share()
            alert = Alert(rule="controller_cannot_fix", signal=d.problem, severity="critical", state=FIRING,
                          run_id=inp.run_id, scope="run", labels={"problem": d.problem}, first_step=inp.step,
                          last_step=inp.step, first_ns=now, last_ns=now, value=share, threshold=self.settings.policy.memory_high,
                          message=d.reason)
            try:
                self.alert_sink.publish([alert], [alert])
            except Exception:
                log.exception("collector: alert sink failed")

    def _hold(self, run: str, step: int, why: str) -> None:
        if self._last_hold.get(run) != why:  # the same hold once, not every tick
            self._last_hold[run] = why
            self._log(run, step, "hold", why)

    def _log(self, run: str, step: int, outcome: str, reason: str) -> None:
        self.decisions.append(Logged(run, step, outcome, reason))
        log.info("controller: run %s step %d: %s: %s", run, step, outcome, reason)
