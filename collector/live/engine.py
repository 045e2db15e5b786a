"""The live engine: committed batches in (from the writer, after commit), alerts and gauges out.

    engine = LiveEngine(rules, con=cursor, sinks=[...], baseline="dp1")
    writer = Writer(con, on_commit=engine.on_commit); engine.start()

The writer thread only appends the committed batches to a bounded inbox and returns (O(1)); the
engine's own thread ingests them into the live state, evaluates each step as it completes (every
rank's STEP row in, or `step_deadline_s` after its first STEP row; the missing ranks are named) and
the time-based rules on a timer (`tick_s`). An inbox over `max_inbox_rows` drops its oldest
batches (counted: `batches_dropped`); a step pushed out of the window before it was evaluated is
counted in `steps_skipped`. Nothing queues without bound.

Alerts go pending -> firing (held `for_steps` completed steps, or `for_s` seconds) -> resolved
(past `clear_below`/`clear_above`, else back under the threshold, for more than the rule's resolve
hold: `keep_firing_steps` cleared steps, or `keep_firing_s`; a breach within the hold is the same
alert, still firing). Each firing or resolved alert
is one row of the `alerts` table (written here, through the engine's own cursor, never the
writer's), and every state change is handed to the sinks.
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from collector.live import judge
from collector.live import lost as lost_mod
from collector.live import signals as sg
from collector.live.model import (
    FIRING,
    PENDING,
    RESOLVED,
    Alert,
    AlertSink,
    CollectorLag,
    RunGauges,
    cause_text,
    culprit_text,
)
from collector.live.rules import DASHBOARD_SIGNALS, Rule
from collector.live.state import MAX_LIVE_BYTES, LiveState, RunState
from tracetop.events import Kind

log = logging.getLogger("tracetop.collector.live")

_LIVE_KINDS = frozenset({Kind.RUN_START, Kind.STEP, Kind.COLLECTIVE, Kind.PIPE_INSTR, Kind.MEMORY, Kind.OFFLOAD,
                         Kind.THROUGHPUT, Kind.HEARTBEAT, Kind.GPU_SAMPLE, Kind.XID})


@dataclass
class _Track:
    alert: Alert
    count: int = 0          # consecutive breached evaluations
    cleared: int = 0        # consecutive cleared evaluations while firing (the resolve hold)
    cleared_ns: int = 0     # when the current cleared streak began
    rule: Rule | None = None
    base: str = ""          # the judge's latest message ({steps} filled), before the book's words
    judged_on: str = ""     # the latest step judged without every rank: "; judged on 6 of 8 ranks (...)"
    fired_on: str = ""      # the same, of the step at which it went firing (kept while it fires)
    note: str = ""          # for a consequence: whose incident it belongs to
    #: (the alert it was computed for, whether that alert opened an incident): Alert.id builds a
    #: string, and the incident checks ask it of every track of a run per alert that fires
    cause_of: tuple = (None, False)

    def is_cause(self) -> bool:
        """Whether this track's alert is an incident's cause (its incident_id is its own id)."""
        a = self.alert
        if self.cause_of[0] is not a:
            self.cause_of = (a, bool(a.incident_id) and a.incident_id == a.id)
        return self.cause_of[1]


#: Faults that hold every other rank up, so that the SLA breaches of the same steps (grad-sync,
#: exposed communication, bubble, stage imbalance, scaling) are their consequences.
PACING = frozenset({"straggler", "data_stall"})
#: Faults of a stopped or silent rank: the first named is the incident; the others named while it is
#: open (waiters stuck in the collective it left, peers the launcher ended, the culprit named again by
#: another of these rules) are its consequences.
HANGS = frozenset({"stuck_collective", "silent_rank", "first_failure", "unheard_rank"})
#: An SLA breach that began up to this many steps before its cause's breach is still its consequence
#: (the two rules see the same onset and hold for different numbers of steps).
SLACK_STEPS = 5
#: For a cause judged on the timer (no step): seconds before its first breach beyond its own threshold
#: (heartbeats come every 5 s).
SLACK_S = 10.0
#: a firing collector_behind alert's row is re-stored this often (how far behind it is now)
BEHIND_STORE_S = 2.0
#: alert rows kept across failed stores (a DuckDB out-of-memory): past it the oldest are dropped, counted
MAX_UNSTORED_ALERT_ROWS = 100_000


@dataclass
class EngineStats:
    batches: int = 0
    rows: int = 0
    batches_dropped: int = 0
    steps_evaluated: int = 0
    steps_skipped: int = 0
    steps_incomplete: int = 0
    eval_s: list[float] | None = None
    dashboard_s: float = 0.0  # the latest dashboard rule's query, seconds (LiveEngine._dashboard_tick)


class AlertBook:
    """Hold, hysteresis, state and incidents per (rule, run, labels). Pure: time and step come in.

    Incidents (Alertmanager's inhibit_rules, done here): a fault that goes firing with no open
    incident to join opens one (its `incident_id` is its own id: it names the culprit and the
    cause); an SLA breach of the same steps that a straggler, data stall or hang explains, a hang
    rule's waiter and a memory alert of another rank of the same run are attached to the open
    incident as consequences (`incident_id` = the cause's id, the message says whose), whichever
    went firing first: an SLA breach that fired before its cause is attached when the cause fires.
    An SLA breach nothing explains stays standalone (`incident_id` ""). Attachment is for good:
    a consequence keeps its incident after the cause resolves."""

    def __init__(self) -> None:
        self.tracks: dict[tuple, _Track] = {}
        self.done: list[Alert] = []  # resolved alerts (latest 1000)

    def update(self, rule: Rule, run_id: str, obs: list[judge.Obs], step: int, now_ns: int,
               time_based: bool = False, judged_on: str = "") -> list[Alert]:
        """One evaluation of `rule` on `run_id`: returns the alerts whose state changed (and the
        alerts of the run that this evaluation attached to an incident). `judged_on`: the step was
        judged without every rank (judge.judged_on_text), which the words of its alerts say."""
        changed: list[Alert] = []
        seen = set()
        # a judgment that is not breached matters only to a track of its own: with none of this
        # rule and run (the usual case), skip building its key (16,384 a step at 16,384 ranks)
        tracked = any(k[0] == rule.name and k[1] == run_id for k in self.tracks)
        for o in obs:
            if not o.breached and not tracked:
                continue
            labels = {**o.labels, **rule.labels}
            key = (rule.name, run_id, tuple(sorted(labels.items())))
            seen.add(key)
            t = self.tracks.get(key)
            if o.breached:
                if t is None:
                    a = Alert(rule.name, rule.signal, rule.severity, PENDING, run_id, o.scope, labels,
                              step if not time_based else -1, step if not time_based else -1, now_ns, now_ns, o.value,
                              rule.threshold, "", kind=rule.alert_kind)
                    t = self.tracks[key] = _Track(a, rule=rule)
                    tracked = fresh = True
                else:
                    fresh = False
                t.count += 1
                t.cleared = 0
                t.judged_on = judged_on
                t.base = o.message.replace("{steps} steps", "1 step" if t.count == 1 else f"{t.count} steps").replace(
                    "{steps}", str(t.count))
                a = t.alert
                new_state = a.state
                held = (now_ns - a.first_ns) / 1e9 >= rule.for_s if rule.for_s else t.count >= rule.for_steps
                if a.state == PENDING and held:
                    new_state = FIRING
                    t.fired_on = judged_on
                last_step = step if not time_based else a.last_step
                fired_step = (step if not time_based else -1) if new_state != a.state else a.fired_step
                t.alert = replace(a, state=new_state, last_step=last_step, last_ns=now_ns, value=o.value,
                                  message=_words(t, fired_step, last_step),
                                  fired_ns=now_ns if new_state != a.state else a.fired_ns, fired_step=fired_step)
                if new_state != a.state or fresh:
                    changed.append(t.alert)
            elif t is not None:
                self._not_breached(key, t, o.value, step, now_ns, changed, time_based)
        for key in [k for k in self.tracks if k[0] == rule.name and k[1] == run_id and k not in seen]:
            self._not_breached(key, self.tracks[key], math.nan, step, now_ns, changed, time_based)
        return self._incidents(run_id, changed)

    # -- incidents ------------------------------------------------------------------------------
    def _incidents(self, run_id: str, changed: list[Alert]) -> list[Alert]:
        """Give each alert that went firing here its incident; a new cause takes the firing SLA
        breaches (and waiters) it explains that stand alone. Work only when something fired."""
        fired = [a for a in changed if a.state == FIRING and not a.incident_id]
        if not fired:
            return changed
        opened: list[_Track] = []
        # the run's open incidents, earliest fired first (ties: the book's order), found once: a step
        # that fires on every one of 16,384 ranks asked each of them of every track (n^2)
        book = list(self.tracks.items())
        causes = [(c.alert.fired_ns, i, c) for i, (k, c) in enumerate(book)
                  if k[1] == run_id and c.alert.state == FIRING and c.is_cause()]
        causes.sort(key=lambda x: x[:2])
        order = {id(c): i for i, (_, c) in enumerate(book)}
        for a in fired:
            t = self.tracks.get(a.key)
            if t is None or t.alert.incident_id:
                continue
            cause = next((c for _, _, c in causes if c is not t and _explains(c, t)), None)
            if cause is not None:
                self._attach(t, cause)
            elif t.alert.kind != "sla":
                t.alert = replace(t.alert, incident_id=t.alert.id)
                opened.append(t)
                if t.alert.state == FIRING:
                    bisect.insort(causes, (t.alert.fired_ns, order[id(t)], t), key=lambda x: x[:2])
        extra: list[Alert] = []
        alone = [t for t in self._run_tracks(run_id) if t.alert.state == FIRING and not t.alert.incident_id]
        for c in opened if alone else ():
            for t in alone:
                if t is not c and not t.alert.incident_id and _explains(c, t):
                    self._attach(t, c)
                    extra.append(t.alert)
        out = [self.tracks[a.key].alert if a.state == FIRING and a.key in self.tracks else a for a in changed]
        return out + extra

    def _run_tracks(self, run_id: str) -> list[_Track]:
        return [t for k, t in self.tracks.items() if k[1] == run_id]

    @staticmethod
    def _attach(t: _Track, c: _Track) -> None:
        ca = c.alert
        t.note = (f"; a consequence of incident {ca.rule} on {culprit_text(ca)} (cause: {cause_text(ca)}), "
                  "not a cause of its own")
        t.alert = replace(t.alert, incident_id=ca.id, message=_words(t))

    def incidents(self, run_id: str | None = None) -> list[tuple[Alert, list[Alert]]]:
        """(cause, its consequences) for the incidents the book holds (open and resolved ones)."""
        alerts = [a for a in self.all() if run_id is None or a.run_id == run_id]
        causes = {a.id: a for a in alerts if a.incident_id and not a.is_consequence}
        out: dict[str, tuple[Alert, list[Alert]]] = {i: (a, []) for i, a in causes.items()}
        for a in alerts:
            if a.is_consequence and a.incident_id in out:
                out[a.incident_id][1].append(a)
        return list(out.values())

    def _not_breached(self, key, t: _Track, value: float, step: int, now_ns: int, changed: list, time_based: bool) -> None:
        a = t.alert
        if a.state == PENDING:
            del self.tracks[key]
            return
        rule = t.rule
        assert rule is not None
        t.count = 0
        if not rule.cleared(value):
            t.cleared = 0  # between the threshold and the hysteresis limit: still firing, the hold restarts
            return
        t.cleared += 1
        if t.cleared == 1:
            t.cleared_ns = now_ns
        if (now_ns - t.cleared_ns) / 1e9 < rule.keep_firing if time_based else t.cleared <= rule.keep_firing:
            return  # the resolve hold: a breach within it continues this alert
        done = replace(a, state=RESOLVED, last_ns=now_ns)
        del self.tracks[key]
        self.done.append(done)
        del self.done[:-1000]
        changed.append(done)

    def end_run(self, run_id: str, now_ns: int) -> list[Alert]:
        """The run is over (every rank silent): its alerts resolve, nothing is left firing."""
        changed = []
        for key in [k for k in self.tracks if k[1] == run_id]:
            a = self.tracks.pop(key).alert
            if a.state == FIRING:
                done = replace(a, state=RESOLVED, last_ns=now_ns)
                self.done.append(done)
                changed.append(done)
        del self.done[:-1000]
        return changed

    def firing(self) -> list[Alert]:
        return [t.alert for t in self.tracks.values() if t.alert.state == FIRING]

    def all(self) -> list[Alert]:
        return [t.alert for t in self.tracks.values()] + list(self.done)


#: what an SLA breach's message ends with
SLA_WORDS = "; an SLA breach, not a fault"


def _words(t: _Track, fired_step: int | None = None, last_step: int | None = None) -> str:
    """The alert's message: the judge's, with the ranks its latest step was judged without (and
    those of the step it went firing on, a judgment a recompute may not repeat), said to be an SLA
    breach where it is one, with whose incident it belongs to where it is a consequence."""
    a = t.alert
    fired_step = a.fired_step if fired_step is None else fired_step
    last_step = a.last_step if last_step is None else last_step
    fired = f"; it went firing on step {fired_step}, {t.fired_on[2:]}" if t.fired_on and fired_step != last_step else ""
    return t.base + t.judged_on + fired + (SLA_WORDS if a.kind == "sla" else "") + t.note


def _explains(c: _Track, t: _Track) -> bool:
    """Is t's alert a consequence of the incident caused by c's alert (same run, both firing)?"""
    ca, a = c.alert, t.alert
    if a.kind == "sla":
        if ca.signal not in PACING | HANGS:
            return False
        if ca.first_step >= 0 and a.first_step >= 0:  # began on the cause's steps, not long before
            return a.first_step >= ca.first_step - SLACK_STEPS
        slack_s = (c.rule.threshold if c.rule is not None and ca.first_step < 0 else 0.0) + SLACK_S
        return a.first_ns >= ca.first_ns - int(slack_s * 1e9)
    if a.kind != "fault":
        return False
    if a.signal in HANGS:
        return ca.signal in HANGS
    if a.signal in PACING:  # the same rank named by the other pacing rule
        return ca.signal in PACING and ca.signal != a.signal and ca.labels.get("rank") == a.labels.get("rank")
    if a.signal == "memory":
        return ca.signal == "memory"
    return False


def alert_id(a: Alert) -> str:
    return a.id


def alert_row(a: Alert) -> tuple:
    def num(key: str) -> int | None:
        v = a.labels.get(key)
        return int(v) if v is not None and str(v).lstrip("-").isdigit() else None

    return (alert_id(a), a.rule, a.signal, a.severity, a.state, a.run_id, a.scope, num("rank"), num("stage"),
            a.labels.get("node"), num("gpu"), json.dumps(dict(a.labels), sort_keys=True), a.first_step, a.last_step,
            a.first_ns, a.last_ns, a.fired_ns or None, a.fired_step, None if a.value != a.value else a.value, a.threshold,
            a.message, a.kind, a.incident_id)


ALERT_COLUMNS = ("id", "rule", "signal", "severity", "state", "run_id", "scope", "rank", "stage", "node", "gpu",
                 "labels", "first_step", "last_step", "first_ns", "last_ns", "fired_ns", "fired_step", "value", "threshold",
                 "message", "kind", "incident_id")


def _insert_alerts(cur, rows: list[tuple]) -> None:
    """INSERT OR REPLACE `rows` (alert_row tuples) into `alerts` in one statement, the last row of an
    id winning (as row-by-row inserts would). executemany ran one statement (and transaction) a row:
    re-storing the firing alerts of 16,384 ranks every step took most of the collector's CPU."""
    import pyarrow as pa

    last = {r[0]: r for r in rows}
    cols = list(zip(*last.values(), strict=True))
    try:
        table = pa.table({name: pa.array(col) for name, col in zip(ALERT_COLUMNS, cols, strict=True)})
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # a column of mixed Python types: row by row
        marks = ", ".join("?" * len(ALERT_COLUMNS))
        cur.executemany(f"INSERT OR REPLACE INTO alerts VALUES ({marks})", list(last.values()))
        return
    names = ", ".join(ALERT_COLUMNS)
    cur.register("_tt_live_alerts", table)
    try:
        cur.execute(f"INSERT OR REPLACE INTO alerts ({names}) SELECT {names} FROM _tt_live_alerts")
    finally:
        cur.unregister("_tt_live_alerts")


class Evaluator:
    """Live state + rules + alert book, without threads (the engine's thread, and --recompute)."""

    def __init__(self, rules: Sequence[Rule], *, window: int = 64, baseline: str | None = None,
                 baseline_lookup: Callable[[str], judge.Baseline | None] | None = None,
                 step_deadline_s: float = 15.0, settle_s: float = 1.0, run_end_s: float = 60.0,
                 evict_after_s: float = 600.0, cost: lost_mod.CostSettings | None = None,
                 max_state_bytes: int = MAX_LIVE_BYTES) -> None:
        self.cost = cost or lost_mod.CostSettings()
        self.evict_after_s = evict_after_s
        self.lost_by_run: dict[str, lost_mod.RunLost] = {}
        self.settle_s = settle_s
        self.run_end_s = run_end_s
        self.rules = [r for r in rules if r.enabled]
        self.state = LiveState(window, max_state_bytes)
        self.book = AlertBook()
        self.baseline_id = baseline
        self.baseline_lookup = baseline_lookup
        self._baseline: judge.Baseline | None = None
        self._baseline_at = 0.0
        self.step_deadline_s = step_deadline_s
        self.stats = EngineStats(eval_s=[])
        self.gauges_by_run: dict[str, RunGauges] = {}
        self.step_rules = [r for r in self.rules if not _time_based(r)]
        self.timer_rules = [r for r in self.rules if _time_based(r) and r.signal not in DASHBOARD_SIGNALS]
        #: judged by the dashboard's SQL on their own cadence (LiveEngine._dashboard_tick), not here
        self.dashboard_rules = [r for r in self.rules if r.signal in DASHBOARD_SIGNALS]
        #: how far behind the collector is (CollectorMetrics.lag): the collector_behind rule's input;
        #: None (a replay, an engine without a collector): that rule judges nothing
        self.collector_lag: Callable[[], CollectorLag] | None = None

    def baseline(self, mono_s: float) -> judge.Baseline | None:
        if self.baseline_id is None or self.baseline_lookup is None:
            return None
        if self._baseline is None and mono_s - self._baseline_at > 5.0:
            self._baseline_at = mono_s
            try:
                self._baseline = self.baseline_lookup(self.baseline_id)
            except Exception:
                log.exception("live: baseline lookup failed")
        return self._baseline

    def ingest(self, kind: Kind, run_id: str, cols: dict, now_ns: int) -> None:
        if kind in _LIVE_KINDS:
            self.state.ingest(kind, run_id, cols, now_ns)

    def dashboard_runs(self) -> dict[str, int]:
        """The runs the dashboard rules judge: those not ended, each at its newest step end (the
        ranks' clock)."""
        return {r.run_id: int(r.slot_end_ns.max()) for r in self.state.runs.values()
                if not r.ended and len(r.slot_end_ns)}

    def ready_steps(self, run: RunState, now_ns: int, *, final: bool = False) -> list[int]:
        """Steps to evaluate now, in order; counts the ones pushed out of the window unevaluated."""
        out = []
        if run.skip_refund:  # an outlier step's jump, undone by a re-anchor: those were never steps
            self.stats.steps_skipped = max(0, self.stats.steps_skipped - run.skip_refund)
            run.steps_skipped = max(0, run.steps_skipped - run.skip_refund)
            run.skip_refund = 0
        lo = max(run.last_evaluated + 1, run.newest_step - run.window + 1)
        if lo > run.last_evaluated + 1 and run.last_evaluated >= 0:
            self.stats.steps_skipped += lo - run.last_evaluated - 1
            run.steps_skipped += lo - run.last_evaluated - 1
            run.skipped_recent += lo - run.last_evaluated - 1
            run.last_evaluated = lo - 1  # counted once
        expected = run.expected_ranks()
        for s in range(lo, run.newest_step + 1):
            slot = run.slot_of(s)
            if slot < 0:
                continue
            n = int(run.present[slot].sum())
            # complete, and settled: the other kinds of the ranks' last shipments are in too
            settled = (now_ns - int(run.slot_last_ns[slot])) / 1e9 >= self.settle_s
            # the deadline runs from the step's first STEP row (a rank finished it), not from its first
            # row: a step longer than the deadline (a hang, a 20 s step) ships collectives all along,
            # and judging it the moment its first rank's STEP row came judged that rank alone
            if n and (final or (n >= expected and settled)
                      or (now_ns - int(run.slot_step_first_ns[slot])) / 1e9 > self.step_deadline_s):
                out.append(s)
                if n < expected:
                    self.stats.steps_incomplete += 1
                    run.steps_incomplete += 1
                    run.last_incomplete_step = s
            elif n == 0 and (now_ns - int(run.slot_first_ns[slot])) / 1e9 > self.step_deadline_s:
                continue  # rows of other kinds only: nothing to judge
            else:
                break
        return out

    def evaluate_ready(self, now_ns: int, mono_s: float, *, final: bool = False) -> list[Alert]:
        changed: list[Alert] = []
        for run in list(self.state.runs.values()):
            for s in self.ready_steps(run, now_ns, final=final):
                t0 = time.perf_counter()
                changed += self.evaluate_step(run, s, now_ns, mono_s)
                run.last_evaluated = run.last_judged = s
                self.stats.steps_evaluated += 1
                ev = self.stats.eval_s
                assert ev is not None
                ev.append(time.perf_counter() - t0)
                del ev[:-4096]
        return changed

    def evaluate_step(self, run: RunState, step: int, now_ns: int, mono_s: float) -> list[Alert]:
        view = judge.step_view(run, step)
        if view is None:
            return []
        fig = judge.step_figures(view, cost=self.cost)
        if fig.lost is not None:
            book = self.lost_by_run.get(run.run_id)
            if book is None:
                book = self.lost_by_run[run.run_id] = lost_mod.RunLost(self.cost.window_s)
            book.add(fig.lost)
        base = self.baseline(mono_s) if run.run_id != self.baseline_id else None
        # a step judged without every rank says so in each alert it raises or updates (the alert's
        # identity, its rule, run and labels, is the same: only its words)
        judged_on = judge.judged_on_text(view)
        changed: list[Alert] = []
        for rule in self.step_rules:
            changed += self.book.update(rule, run.run_id, judge.observe(rule, fig, base), step, now_ns,
                                        judged_on=judged_on)
        self._gauges(run, fig, base)
        return changed

    def _gauges(self, run: RunState, f: judge.Figures, base: judge.Baseline | None) -> None:
        eff = f.per_gpu_tokens_per_s / base.per_gpu_tokens_per_s if base and base.per_gpu_tokens_per_s > 0 \
            else f.within_efficiency
        used = judge.sg.memory_used_of_budget(f.memory_used, f.memory_budget)
        mfu = f.view.cols["mfu"]
        self.gauges_by_run[run.run_id] = RunGauges(
            run_id=run.run_id, step=f.view.step, ranks=len(f.view.rank), step_ms_p50=f.step_ms_p50,
            grad_sync_ms_p99=f.grad_sync_p99_ms, comm_share=f.comm_share, scaling_efficiency=eff,
            tokens_per_s=f.per_gpu_tokens_per_s * f.view.world, samples_per_s_per_gpu=_per_gpu_samples(f),
            mfu=float(np.nanmedian(mfu)) if (~np.isnan(mfu)).any() else math.nan,
            bubble_by_stage={b.stage: b.bubble for b in f.budgets},
            memory_used_of_budget_max=float(np.nanmax(used)) if (~np.isnan(used)).any() else math.nan,
            firing_alerts=sum(1 for a in self.book.firing() if a.run_id == run.run_id),
            **_incomplete(run),
            **self._lost_gauges(run.run_id),
        )

    def _lost_gauges(self, run_id: str) -> dict:
        book = self.lost_by_run.get(run_id)
        if book is None:
            return {}
        causes, wall_ms, ranks, span = book.window()
        top, share = book.top_rank()
        wtop, wshare = lost_mod.top_rank(ranks, sum(causes.values()))
        return dict(
            lost_gpu_s={c: v / 1e3 for c, v in book.gpu_ms.items()},
            lost_window_gpu_s={c: v / 1e3 for c, v in causes.items()},
            lost_window_s=book.window_s, lost_window_span_s=span, held_gpu_s=book.held_gpu_ms / 1e3,
            lost_top_rank=top, lost_top_rank_share=share, lost_window_top_rank=wtop, lost_window_top_rank_share=wshare,
            lost_window_gpus=sum(causes.values()) / wall_ms if wall_ms > 0 else math.nan,
            price_per_gpu_hour=self.cost.price_per_gpu_hour, currency=self.cost.currency if self.cost.priced else "",
        )

    def evaluate_timer(self, now_ns: int) -> list[Alert]:
        changed: list[Alert] = []
        for run in list(self.state.runs.values()):
            # a run whose every rank fell silent for run_end_s has ended: resolve what it left firing
            last = int(run.hb_ns.max()) if run.ranks else 0
            if last and not run.ended and (now_ns - last) / 1e9 > self.run_end_s:
                run.ended, run.ended_at_ns = True, now_ns
                changed += self.book.end_run(run.run_id, now_ns)
            elif last and (now_ns - last) / 1e9 <= self.run_end_s:
                if run.ended:  # heard again (a spool's late delivery, a resumed run): judged afresh
                    run.first_failure, run.hang_named = None, -1
                run.ended = False
            # its live state goes once nothing was heard of it for evict_after_s (the collector's
            # clock): an ended run's, and a run's that never beat
            if (now_ns - run.last_row_ns) / 1e9 > self.evict_after_s and (run.ended or not last):
                changed += self.book.end_run(run.run_id, now_ns)
                self.state.evict(run.run_id)
                self.lost_by_run.pop(run.run_id, None)
                self.gauges_by_run.pop(run.run_id, None)
        has_first_failure = any(r.signal == "first_failure" for r in self.timer_rules)
        for rule in self.timer_rules:
            if rule.signal in ("silent_rank", "stuck_collective"):
                for run in list(self.state.runs.values()):
                    if run.ended:
                        continue
                    got = self.book.update(rule, run.run_id, self._hang_obs(rule, run, now_ns, has_first_failure),
                                           -1, now_ns, True)
                    for a in got:
                        if a.state == FIRING and run.hang_named < 0 and "rank" in a.labels:
                            run.hang_named = int(a.labels["rank"])
                    changed += got
            elif rule.signal in ("first_failure", "unheard_rank"):
                for run in list(self.state.runs.values()):
                    if run.ended:
                        continue
                    obs = self._first_failure_obs(rule, run, now_ns) if rule.signal == "first_failure" \
                        else self._unheard_obs(rule, run, now_ns)
                    changed += self.book.update(rule, run.run_id, obs, -1, now_ns, True)
            elif rule.signal == "collector_behind":
                changed += self._collector_rule(rule, now_ns)
            else:
                changed += self._gpu_rule(rule, now_ns)
        return changed

    def _collector_rule(self, rule: Rule, now_ns: int) -> list[Alert]:
        if self.collector_lag is None:
            return []
        lag = self.collector_lag()
        obs = judge.Obs("collector", {}, lag.behind_s, rule.breached(lag.behind_s), behind_message(lag))
        return self.book.update(rule, "", [obs], -1, now_ns, True)

    @staticmethod
    def _ranks_text(ranks) -> str:
        ranks = [int(r) for r in ranks]
        shown = ", ".join(map(str, ranks[:8]))
        return shown + (f" (and {len(ranks) - 8} more)" if len(ranks) > 8 else "")

    @staticmethod
    def _pending_text(run: RunState, r: int) -> str:
        op = str(run.hb_op[r])
        return f"in {op} (role {run.hb_role[r]})" if op else "in no collective"

    def _first_failure_obs(self, rule: Rule, run: RunState, now_ns: int) -> list[judge.Obs]:
        """The run stopped (every rank heard either closed cleanly, or silent past the threshold) and
        at least one rank ended without its clean close, or a rank of its world size was never
        heard: the rank that went first is named, once. First: a rank never heard; else the rank
        not closed whose latest row (heartbeat, step or collective, its own clock) is the earliest.
        Not named when a hang rule already named the run's culprit before it stopped."""
        if run.first_failure is not None:
            return [run.first_failure]
        if not run.ranks or run.hang_named >= 0:
            return []
        last = np.maximum(run.hb_ns, run.seen_ns)
        heard = last > 0
        if not heard.any():
            return []
        closed = heard & (run.hb_phase == "closed")
        unclosed = np.nonzero(heard & ~closed)[0]
        world = run.world_size
        never = [r for r in range(min(world, run.ranks)) if not heard[r]] + list(range(run.ranks, world))
        if not len(unclosed) and not never:
            return []  # every rank closed: the run is over
        if len(unclosed) and (now_ns - last[unclosed]).min() / 1e9 <= rule.threshold:
            return []  # a rank still beats: the run has not stopped (silent_rank / unheard_rank judge it)
        if not len(unclosed) and (now_ns - last[heard]).min() / 1e9 <= rule.threshold:
            return []  # the last ranks closed just now: wait as long for the never-heard one
        stopped_s = float((now_ns - last[heard]).min() / 1e9)
        after = [f"ranks {self._ranks_text(unclosed)} ended without their clean close"] if len(unclosed) else []
        if never:
            first = never[0]
            what = (f"rank {first} of {world} failed first: it was never heard from (no heartbeat, no row)"
                    + (f"; ranks {self._ranks_text(never[1:])} neither" if len(never) > 1 else ""))
            step = -1
        else:
            first = int(unclosed[np.argmin(last[unclosed])])
            rest = [r for r in unclosed.tolist() if r != first]
            lead = (float(last[rest].min() - last[first]) / 1e9) if rest else math.nan
            step = int(max(run.seen_step[first], run.hb_step[first]))
            phase = str(run.hb_phase[first]) or "unknown"
            what = (f"rank {first} failed first: ended without its clean close, last heard at step {step} "
                    f"(phase {phase}, {self._pending_text(run, first)})"
                    + (f", {lead:.1f} s before any other rank" if rest else ""))
            after = [f"ranks {self._ranks_text(rest)} ended without their clean close after it"] if rest else []
        if closed.any():
            after.append(f"ranks {self._ranks_text(np.nonzero(closed)[0])} closed")
        labels = {"rank": str(first)}
        stage = int(run.stage[first]) if first < run.ranks else -1
        if stage >= 0:
            labels["stage"] = str(stage)
        msg = what + (f"; then {'; '.join(after)}" if after else "") + f"; the run stopped {stopped_s:.0f} s ago"
        if step >= 0:
            labels["step"] = str(step)
        run.first_failure = judge.Obs("rank", labels, stopped_s, True, msg)
        return [run.first_failure]

    def _unheard_obs(self, rule: Rule, run: RunState, now_ns: int) -> list[judge.Obs]:
        """Ranks of the run's world size never heard from (no row of any kind) while peers are heard,
        the threshold after the run's first row: each is named (up to 16), with the peers waiting."""
        world = run.world_size
        if world <= 0 or not run.first_ns:
            return []
        last = np.maximum(run.hb_ns, run.seen_ns)
        heard = last > 0
        never = [r for r in range(min(world, run.ranks)) if not heard[r]] + list(range(run.ranks, world))
        if not never:
            return []
        alive = np.nonzero(heard & (run.hb_phase != "closed") & ((now_ns - last) / 1e9 <= rule.threshold))[0]
        since_s = (now_ns - run.first_ns) / 1e9
        if not len(alive) or since_s <= rule.threshold:
            return []
        waiting = [int(r) for r in alive if run.hb_op[r]]
        ops = sorted({f"{run.hb_op[r]} (role {run.hb_role[r]})" for r in waiting})
        wait = (f"; ranks {self._ranks_text(waiting)} wait in {', '.join(ops)}, a collective it never joined"
                if waiting else "")
        more = f" ({len(never)} ranks never heard)" if len(never) > 1 else ""
        out = []
        for r in never[:16]:
            out.append(judge.Obs("rank", {"rank": str(r)}, since_s, True,
                                 f"rank {r} of {world} was never heard from: no heartbeat or row in {since_s:.0f} s "
                                 f"since the run's first, while ranks {self._ranks_text(alive)} report{more}{wait}"))
        return out

    def _hang_obs(self, rule: Rule, run: RunState, now_ns: int, defer_stopped: bool = False) -> list[judge.Obs]:
        heard = np.nonzero(run.hb_ns > 0)[0]
        # a rank whose last heartbeat is its clean close (phase "closed") ended: it is never silent, so
        # silent_rank judges the ranks that did not close alone (one killed while its peers closed is
        # named). stuck_collective keeps every rank: a closed one is a rank that left the collective
        # (e.g. the hung rank ended by its timeout), which must not turn its waiters into culprits.
        closed = heard[run.hb_phase[heard] == "closed"]
        if rule.signal == "silent_rank":
            heard = heard[run.hb_phase[heard] != "closed"]
        if len(heard) == 0:
            return []
        stopped = (now_ns - run.hb_ns[heard]).min() / 1e9 > rule.threshold
        # a run whose every rank fell silent without any closing has ended (or died whole): nothing
        # to single out here; with a first_failure rule on, a run that stopped is that rule's to
        # judge (it names the rank that went first, once)
        if stopped and rule.signal == "silent_rank" and (defer_stopped or not len(closed)):
            return []
        big = 1e18
        silent_rule = next((r for r in self.timer_rules if r.signal == "silent_rank"), None)
        if rule.signal == "stuck_collective" and any(r.signal == "unheard_rank" for r in self.timer_rules):
            last = np.maximum(run.hb_ns, run.seen_ns)
            if run.world_size > 0 and (run.world_size > run.ranks or not (last[: run.world_size] > 0).all()):
                # a rank of the world size never heard: the stuck ones wait for it (a collective it
                # never joined), unheard_rank names it; none of them is a culprit
                return []
        silent_s = rule.threshold if rule.signal == "silent_rank" else big
        stuck_s = rule.threshold if rule.signal == "stuck_collective" else big
        # the culprit logic needs both views: a silent rank makes the stuck ones waiters
        findings = sg.hangs(heard, run.hb_ns[heard], run.hb_step[heard], list(run.hb_op[heard]),
                            list(run.hb_role[heard]), run.hb_since[heard], _UsualSigs(run, heard), now_ns,
                            silent_s=silent_s, stuck_s=stuck_s, phases=list(run.hb_phase[heard]),
                            first_ns=run.hb_first_ns[heard], beating_s=rule.threshold,
                            was_stuck=(run.hb_held_step[heard] == run.hb_step[heard]) & (run.hb_held_ns[heard] / 1e9 > stuck_s))
        out = []
        for h in findings:
            wait = f"; ranks {', '.join(map(str, h.waiting))} wait on it (blocked in their own collectives, not " \
                   f"culprits)" if h.waiting else ""
            stage = int(run.stage[h.rank]) if h.rank < run.ranks else -1
            labels = {"rank": str(h.rank)}
            if stage >= 0:
                labels["stage"] = str(stage)
            if h.kind == "silent" and rule.signal == "silent_rank":
                if defer_stopped and not self._others_beat_after(run, heard, h.rank, rule.threshold / 2):
                    continue  # its peers went quiet with it: a run stopping, first_failure's to judge
                others = (f"without its clean close, while rank(s) {', '.join(map(str, closed.tolist()))} closed"
                          if len(closed) else "while the others still beat")
                out.append(judge.Obs("rank", labels, h.seconds, True,
                                     f"rank {h.rank} sent no heartbeat for {h.seconds:.0f} s (last at step {h.step}) "
                                     f"{others}{wait}"))
            elif h.kind == "stalled" and rule.signal == "stuck_collective":
                if self._named(run.run_id, h.rank, "silent_rank"):
                    continue  # it was frozen, and is heard again: silent_rank named it already
                labels["cause"] = "stalled"
                out.append(judge.Obs("rank", labels, h.seconds, True,
                                     f"rank {h.rank} is stalled in its own {h.phase or 'work'} at step {h.step} (in no "
                                     f"collective, still beating) while the others have waited {h.seconds:.0f} s for it"
                                     f"{wait}"))
            elif h.kind == "stuck" and rule.signal == "stuck_collective":
                if silent_rule is not None and (now_ns - int(run.hb_ns[h.rank])) / 1e9 > rule.threshold / 2 \
                        and not self._named(run.run_id, h.rank, rule.signal):
                    # not heard since it entered the collective: a frozen (SIGSTOPped) or dead rank
                    # going silent, silent_rank's to name, once (not a second alert here first). Once
                    # named stuck, the gap between two heartbeats (longer than half the threshold
                    # with a slow heartbeat or a late delivery) does not resolve it: it stays named
                    # until it leaves the collective or goes silent (then silent_rank names it)
                    continue
                labels.update(op=h.op, role=h.role)
                out.append(judge.Obs("rank", labels, h.seconds, True,
                                     f"rank {h.rank} is stuck in {h.op} (role {h.role}) for {h.seconds:.0f} s at step "
                                     f"{h.step}{wait}"))
        return out

    def _named(self, run_id: str, rank: int, signal: str) -> bool:
        """A `signal` alert on `rank` of the run is firing."""
        return any(t.alert.state == FIRING and t.alert.signal == signal and t.alert.run_id == run_id
                   and t.alert.labels.get("rank") == str(rank) for t in self.book.tracks.values())

    @staticmethod
    def _others_beat_after(run: RunState, heard: np.ndarray, rank: int, margin_s: float) -> bool:
        """Another rank not closed beat at least margin_s after `rank`'s last heartbeat: it lived on
        while `rank` was silent (ranks a launcher ended a moment after it did not)."""
        others = heard[heard != rank]
        return bool(len(others)) and int(run.hb_ns[others].max()) >= int(run.hb_ns[rank]) + int(margin_s * 1e9)

    def _gpu_rule(self, rule: Rule, now_ns: int) -> list[Alert]:
        obs = []
        for g in self.state.gpus.values():
            labels = {"node": g.node, "gpu": str(g.gpu)}
            if rule.signal == "xid":
                n = len(g.xids)
                last = f" (latest XID {g.xids[-1][1]}: {g.xids[-1][2]})" if n else ""
                obs.append(judge.Obs("gpu", labels, float(n), rule.breached(float(n)),
                                     f"GPU {g.gpu} on {g.node} reported {n} XID event(s){last}"))
            elif rule.signal == "thermal_throttle":
                val = 1.0 if g.throttled else 0.0
                held = (now_ns - g.throttled_since_ns) / 1e9 if g.throttled else 0.0
                obs.append(judge.Obs("gpu", labels, val, rule.breached(val),
                                     f"GPU {g.gpu} on {g.node} is thermal/power throttled for {held:.0f} s"))
            elif rule.signal == "ecc":
                obs.append(judge.Obs("gpu", labels, g.ecc_uncorrected, rule.breached(g.ecc_uncorrected),
                                     f"GPU {g.gpu} on {g.node} has {g.ecc_uncorrected:.0f} uncorrected ECC errors"))
        return self.book.update(rule, "", obs, -1, now_ns, True)


class _UsualSigs:
    """`RunState.usual_sigs(ranks)` asked one rank at a time, as signals.hangs asks it: of the ranks
    stuck in a collective only (a window's scan per rank; for all 16,384 ranks twice a tick it was
    most of the live thread's timer work, and none was stuck)."""

    def __init__(self, run: RunState, ranks: np.ndarray) -> None:
        self.run, self.ranks = run, ranks

    def __getitem__(self, i: int) -> frozenset[tuple[str, str]]:
        return self.run.usual_sigs(self.ranks[i:i + 1])[0]

    def __len__(self) -> int:
        return len(self.ranks)


def behind_message(lag: CollectorLag) -> str:
    """The collector_behind alert's words: how far behind, and what to do."""
    held = f", {lag.streams_held} stream{'s' if lag.streams_held != 1 else ''} held by backpressure" \
        if lag.streams_held else ""
    return (f"the collector has been behind for {lag.behind_s:.0f} s: its oldest batch not yet committed has "
            f"waited {lag.oldest_wait_s:.1f} s{held}, {lag.queue_mb:.0f} MB queued; the shippers counted "
            f"{lag.rows_not_stored:,} rows as not stored (gap rows) since it fell behind (they keep, spool, or drop "
            "and count what it cannot take). Give it more CPU, shard the nodes over more collectors, or ship less "
            "(docs/benchmarks.md, the knee of one collector)")


def _incomplete(run: RunState | None) -> dict:
    """The run's counts of steps judged without every rank and of steps skipped unjudged, as of now
    (the gauges were taken at its latest judged step: a later step's counts are already in the
    run's state). Per run: another run's skips are not this one's."""
    if run is None:
        return {}
    return {"steps_incomplete": run.steps_incomplete, "last_incomplete_step": run.last_incomplete_step,
            "steps_skipped": run.steps_skipped}


def _per_gpu_samples(f: judge.Figures) -> float:
    c = f.view.cols
    ok = (c["samples"] >= 0) & (c["duration_ns"] > 0)
    if not ok.any():
        return math.nan
    return float(np.median(c["samples"][ok] / (c["duration_ns"][ok] / 1e9))) * f.view.dp / f.view.world


def _time_based(rule: Rule) -> bool:
    from collector.live.rules import SIGNALS

    return SIGNALS[rule.signal].time_based


class LiveEngine:
    """The Evaluator on its own thread, fed by the writer's on_commit, writing the alerts table."""

    def __init__(self, rules: Sequence[Rule], *, con=None, sinks: Sequence[AlertSink] = (), baseline: str | None = None,
                 window: int = 64, tick_s: float = 0.5, step_deadline_s: float = 15.0, settle_s: float = 1.0,
                 max_inbox_rows: int = 4_000_000, clock_ns: Callable[[], int] = time.time_ns,
                 cost: lost_mod.CostSettings | None = None,
                 collector_lag: Callable[[], CollectorLag] | None = None,
                 max_state_bytes: int = MAX_LIVE_BYTES) -> None:
        self._cur = con
        lookup = (lambda run_id: lookup_baseline(self._cur, run_id)) if con is not None else None
        self.ev = Evaluator(rules, window=window, baseline=baseline, baseline_lookup=lookup,
                            step_deadline_s=step_deadline_s, settle_s=settle_s, cost=cost,
                            max_state_bytes=max_state_bytes)
        self.ev.collector_lag = collector_lag
        self.sinks = list(sinks)
        self.tick_s = tick_s
        self.clock_ns = clock_ns
        self.max_inbox_rows = max_inbox_rows
        self._inbox: collections.deque = collections.deque()
        self._inbox_rows = 0
        self._cv = threading.Condition()
        self._stop = False
        self._lock = threading.Lock()  # guards the evaluator against readers (gauges/alerts)
        self._thread = threading.Thread(target=self._run, name="tracetop-live", daemon=True)
        self.errors = 0
        self._unstored: list[tuple] = []  # alert rows a failed store kept (retried with the next)
        self.alert_rows_lost = 0  # alert rows dropped past MAX_UNSTORED_ALERT_ROWS kept ones (counted)
        self._behind_stored = 0.0  # monotonic time a firing collector_behind row was last re-stored
        self._dash_next: dict[str, float] = {}  # rule name -> monotonic time of its next evaluation
        self._dash_stop = threading.Event()
        # the dashboard thread's own cursor (a DuckDB connection is not shared between threads)
        self._dash_cur = con.cursor() if con is not None and any(
            r.signal in DASHBOARD_SIGNALS for r in self.ev.rules) else None
        self._dash_thread = threading.Thread(target=self._dashboard_loop, name="tracetop-live-dashboard", daemon=True)

    @property
    def stats(self) -> EngineStats:
        return self.ev.stats

    # -- the writer's side: O(1), never blocks on evaluation ----------------------------------
    def on_commit(self, batches: Sequence) -> None:
        rows = sum(b.n for b in batches)
        with self._cv:
            self._inbox.append(batches)
            self._inbox_rows += rows
            while self._inbox_rows > self.max_inbox_rows and len(self._inbox) > 1:
                dropped = self._inbox.popleft()
                self._inbox_rows -= sum(b.n for b in dropped)
                self.ev.stats.batches_dropped += len(dropped)
            self._cv.notify()

    def start(self) -> None:
        self._thread.start()
        if self._dash_cur is not None:
            self._dash_thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ingest what is queued, evaluate the steps that are in, stop."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout_s)
        if self._unstored and not self._thread.is_alive():  # a failed store's rows: one more try
            with self._lock:
                self._store([])
        if self._dash_thread.is_alive():  # then the dashboard rules once more, over everything ingested
            self._dash_stop.set()
            self._dash_thread.join(timeout_s)
            try:
                self._dashboard_tick(final=True)
            except Exception:
                self.errors += 1
                log.exception("live: the dashboard rules failed")
            self._dash_cur.close()  # type: ignore[union-attr]
        for s in self.sinks:
            try:
                s.close()
            except Exception:
                log.exception("live: a sink failed to close")

    def _run(self) -> None:
        next_tick = time.monotonic() + self.tick_s
        while True:
            with self._cv:
                if not self._inbox and not self._stop:
                    self._cv.wait(max(0.0, next_tick - time.monotonic()))
                items = list(self._inbox)
                self._inbox.clear()
                self._inbox_rows = 0
                stop = self._stop
            try:
                with self._lock:
                    now = self.clock_ns()
                    for batches in items:
                        for b in batches:
                            self.ev.ingest(b.kind, b.run_id, b.columns, now)
                            self.ev.stats.batches += 1
                            self.ev.stats.rows += b.n
                    judged = self.ev.stats.steps_evaluated
                    changed = self.ev.evaluate_ready(now, time.monotonic())
                    ticked = time.monotonic() >= next_tick or stop
                    if ticked:
                        next_tick = time.monotonic() + self.tick_s
                        changed += self.ev.evaluate_timer(now)
                    firing = self.ev.book.firing()
                    ids = {alert_id(a) for a in changed}
                    if changed or self.ev.stats.steps_evaluated > judged:
                        # state changes, and the firing alerts' latest step / value / message
                        self._store(changed + [a for a in firing if alert_id(a) not in ids and a.first_step >= 0])
                    if ticked and time.monotonic() >= self._behind_stored + BEHIND_STORE_S:
                        # a firing collector_behind row says how far behind now, not only when it fired
                        self._behind_stored = time.monotonic()
                        self._store([a for a in firing if a.signal == "collector_behind" and alert_id(a) not in ids])
                if changed:
                    self._publish(changed, firing)
            except Exception:  # the engine never takes the collector down
                self.errors += 1
                log.exception("live: evaluation failed")
            if stop:
                return

    def _dashboard_loop(self) -> None:
        while not self._dash_stop.wait(1.0):
            try:
                self._dashboard_tick()
            except Exception:  # the engine never takes the collector down
                self.errors += 1
                log.exception("live: the dashboard rules failed")

    def _dashboard_tick(self, final: bool = False) -> None:
        """The dashboard's judgments (cross_node_share, hardware_risk, fragmentation) that are due:
        each an SQL query over its last window_s of rows, every every_s, on a thread of their own,
        outside the lock (step evaluation and readers are not held by it). Once more at close."""
        mono = time.monotonic()
        due = [r for r in self.ev.dashboard_rules if final or mono >= self._dash_next.get(r.name, 0.0)]
        if not due:
            return
        with self._lock:  # what is live: runs not ended (their newest step end, the ranks' clock), GPUs
            runs = self.ev.dashboard_runs()
            gpu_ns = max((g.last_ns for g in self.ev.state.gpus.values()), default=0)
        found = []
        for rule in due:
            every, _ = dashboard_settings(rule)
            self._dash_next[rule.name] = mono + every
            t0 = time.perf_counter()
            try:
                found.append((rule, dashboard_obs(self._dash_cur, rule, runs, gpu_ns)))
            except Exception:
                self.errors += 1
                log.exception("live: the %s rule's query failed", rule.name)
            self.ev.stats.dashboard_s = time.perf_counter() - t0
        changed: list[Alert] = []
        with self._lock:
            now = self.clock_ns()
            for rule, by_run in found:
                for run_id, obs in by_run.items():
                    changed += self.ev.book.update(rule, run_id, obs, -1, now, True)
            firing = self.ev.book.firing()
            self._store(changed)
        if changed:
            self._publish(changed, firing)

    def _store(self, changed: list[Alert]) -> None:
        """Store `changed` (and the rows an earlier store failed to write: kept, retried with the next
        store and at close; the last row of an alert wins, so a later row of it supersedes them)."""
        if self._cur is None:
            return
        rows = self._unstored + [alert_row(a) for a in changed if a.state != PENDING]
        if not rows:
            return
        try:
            _insert_alerts(self._cur, rows)
            self._unstored = []
        except Exception:
            self.errors += 1
            kept = rows[-MAX_UNSTORED_ALERT_ROWS:]
            self.alert_rows_lost += len(rows) - len(kept)
            self._unstored = kept
            log.exception("live: could not store %d alert rows (kept: stored with the next alert rows)", len(rows))

    def _publish(self, changed: list[Alert], firing: list[Alert]) -> None:
        for s in self.sinks:
            try:
                s.publish(changed, firing)
            except Exception:
                self.errors += 1
                log.exception("live: sink %r failed", s)

    def raise_alert(self, alert: Alert) -> None:
        """An alert from outside the rules (the controller's ``controller_cannot_fix``): into the
        book as firing (so ``alerts()``, OTLP and every later publish carry it; no rule judges it,
        it resolves when the run ends), the `alerts` table, and every sink. Any thread."""
        with self._lock:
            a = replace(alert, state=FIRING, fired_ns=alert.fired_ns or alert.last_ns,
                        fired_step=alert.fired_step if alert.fired_step >= 0 else alert.last_step)
            if not a.incident_id and a.kind != "sla":
                a = replace(a, incident_id=a.id)  # an incident of its own
            self.ev.book.tracks[(a.rule, a.run_id, tuple(sorted(a.labels.items())))] = _Track(a, count=1)
            firing = self.ev.book.firing()
            self._store([a])
        self._publish([a], firing)

    # -- readers (exporters, the TUI's Watch) --------------------------------------------------
    def gauges(self) -> list[RunGauges]:
        with self._lock:
            firing = self.ev.book.firing()
            runs = self.ev.state.runs
            return [replace(g, firing_alerts=sum(1 for a in firing if a.run_id == g.run_id),
                            **_incomplete(runs.get(g.run_id))) for g in self.ev.gauges_by_run.values()]

    def alerts(self, firing_only: bool = False) -> list[Alert]:
        with self._lock:
            return self.ev.book.firing() if firing_only else self.ev.book.all()

    def read(self, fn: Callable[[LiveState], object]) -> object:
        """fn(the live state) under the engine's lock, between two ingests: the readers' way in
        (Query.Watch's snapshots, the controller's EngineInputs). fn must be quick and must not keep
        references to the arrays."""
        with self._lock:
            return fn(self.ev.state)

    #: the controller's EngineInputs name for the same way in
    read_state = read

    def live_state_bytes(self) -> int:
        with self._lock:
            return self.ev.state.nbytes

    def rows_refused(self) -> int:
        """Rows the live state did not take (its budget full, a rank outside the world, ...; by
        reason: `LiveState.refused`), over the runs it holds: their ranks were not judged live."""
        with self._lock:
            return sum(self.ev.state.refused(evicted=True).values())


def dashboard_settings(rule: Rule) -> tuple[float, float]:
    """(every_s, window_s) of a dashboard rule: its own, else its signal's defaults."""
    every, window = DASHBOARD_SIGNALS[rule.signal]
    return rule.params.get("every_s", every), rule.params.get("window_s", window)


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def dashboard_obs(cur, rule: Rule, runs: dict[str, int], gpu_ns: int) -> dict[str, list[judge.Obs]]:
    """A dashboard rule's observations by run id ("" for the GPUs'): its SQL (collector/query/
    dashboard.py) over the rows of its last window_s, up to `runs`' newest step end (the ranks'
    clock) or `gpu_ns` (the agents' newest sample). Values in the hysteresis band are observed too."""
    from collector.query import dashboard

    _, window = dashboard_settings(rule)
    lim = min(rule.threshold, rule.clear) if rule.clear is not None else rule.threshold
    out: dict[str, list[judge.Obs]] = {}
    if rule.signal == "hardware_risk":
        if gpu_ns <= 0:
            return {}
        where = f"start_ns >= {gpu_ns - int(window * 1e9)}"
        rows = dashboard.risky_gpus(cur, min_points=math.floor(lim) + 1, where=where)
        out[""] = [judge.Obs("gpu", {"node": str(r["node"]), "gpu": str(r["gpu"])}, float(r["points"]),
                             rule.breached(float(r["points"])), str(r["message"])) for r in rows]
        return out
    for run_id, newest in runs.items():
        where = f"run_id = {_sql_str(run_id)} AND start_ns >= {newest - int(window * 1e9)}"
        obs = out[run_id] = []
        if rule.signal == "cross_node_share":
            # a run on one node has nothing to judge: a cheap look (run_start: a row per rank) first
            if cur.execute("SELECT count(DISTINCT hostname) FROM run_start WHERE run_id = ?",
                           [run_id]).fetchone()[0] < 2:
                continue
            for r in dashboard.cross_node_groups(cur, run_id, threshold=lim, where=where):
                val = float(r["cross_time_share"])
                obs.append(judge.Obs("role", {"role": str(r["role"]), "group": str(r["group"])}, val,
                                     rule.breached(val),
                                     f"group {r['group']} ({r['role']}, {r['nodes']} nodes) spends {val:.0%} of its "
                                     f"communication time ({r['time_ms']:.0f} ms in the last {window:.0f} s) on "
                                     f"cross-node links, above {rule.threshold:.0%}; {r['cross_bytes_share']:.0%} "
                                     f"of its bytes cross"))
        elif rule.signal == "fragmentation":
            # nor a run without the device allocator's figures (CPU): the first such row decides
            if not cur.execute(f"SELECT 1 FROM memory WHERE {where} AND allocated_bytes >= 0 AND reserved_bytes > 0 "
                               "LIMIT 1").fetchall():
                continue
            share = rule.params.get("frag_share_above", dashboard.FRAG_SHARE)
            for r in dashboard.fragmenting_ranks(cur, run_id, rise=lim, share=share, where=where):
                val = float(r["frag_share_per_100_steps"])
                obs.append(judge.Obs("rank", {"rank": str(r["rank"])}, val, rule.breached(val),
                                     f"rank {r['rank']}'s allocator fragmentation ((reserved - allocated) / "
                                     f"reserved) rose from {r['frag_share_first']:.0%} to {r['frag_share_last']:.0%} "
                                     f"over {r['steps']} steps ({val:+.2f} per 100 steps, above "
                                     f"{rule.threshold:g}): memory is held but not usable"))
    return out


def lookup_baseline(cur, run_id: str) -> judge.Baseline | None:
    """A stored run's figures from the `run_scaling` view (None while it has no steps)."""
    rows = cur.cursor().execute(
        "SELECT dp, per_gpu_tokens_per_s, grad_sync_ms_p50 FROM run_scaling WHERE run_id = ?", [run_id]).fetchall()
    row = rows[0] if rows else None
    if row is None or row[1] is None:
        return None
    return judge.Baseline(run_id, int(row[0] or 1), float(row[1]), float(row[2]) if row[2] is not None else math.nan)
