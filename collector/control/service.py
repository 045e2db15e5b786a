"""The collector's Control service: actions in (a person, or the controller), commands out to
rank 0's hooks (``Poll``, or a held ``Subscribe`` stream), every rank's status back (``Report``), the `actions` table.

Requests run on the collector's event loop thread; the `actions` / `action_ranks` rows are written
off it, by one thread of the control path's own with a cursor of its own (DuckDB allows it beside
the ingest writer's; the tables are the control path's alone), in batches: every change is queued
and the thread writes all that is queued in one transaction (a command to 16k ranks brings 32k
reports: written on the loop, one statement each, they held ingest up for minutes). ``Submit``
answers only once its change is written, so the file shows an action's state when the caller hears it.

Who may report, and who is handed a command (the ranks hold only an ingest credential, so these are
checked here): a report counts toward an action only when its rank is inside the run's world size
and its ``source_key`` (the rank's shipper start) is one the collector heard ship this run's rows
as this rank (``heard``, fed by the writer's commits; after a collector restart, until the start is
heard again, a start the file's ``sources`` table knows); any other report is refused, counted
(``reports_refused``) and logged once per reason. A command is handed only to a rank 0 start heard
before it was approved: a job restarted under the same run id (a new start) does not receive its
predecessor's commands, which are marked lost, saying so.

A command is refused at once, with the reason, and nothing is stored or sent, when the run is
unknown (no RUN_START rows), or the run cannot apply it (see ``check.refusal``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from collector.control import actions as act
from collector.control import profiles
from collector.control.check import RunShape, profile_refusal, refusal
from tracetop.errors import TracetopError
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc

log = logging.getLogger("tracetop.collector")

DEFAULT_TTL_S = 600.0


class ControlError(TracetopError):
    """A request refused: ``code`` is the gRPC status it is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


#: the most shipper starts whose (run, rank) is kept for the report check; past it the least
#: recently heard go (a forgotten start falls back to the file's `sources` table)
MAX_SOURCES = 1 << 18
#: the most Subscribe streams one run may hold (each a queue); more are refused, counted
MAX_SUBSCRIBERS_PER_RUN = 64


class ControlService:
    def __init__(self, con, *, ttl_s: float = DEFAULT_TTL_S, clock_ns: Callable[[], int] = time.time_ns,
                 max_sources: int = MAX_SOURCES) -> None:
        self._cur = con.cursor()
        self._wcur = con.cursor()  # the writing thread's
        self.ttl_ns = int(ttl_s * 1e9)
        self._clock_ns = clock_ns
        self.actions: dict[str, act.Action] = {}
        self.subscribers: dict[str, set[asyncio.Queue]] = defaultdict(set)
        self.listeners: list[Callable[[act.Action], None]] = []  # the controller hears of changes
        self._next_id = 1
        # shipper start (codec.source_key) -> (run_id, rank, collector ns when first heard)
        self.max_sources = max_sources
        self._sources: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
        self._sources_lock = threading.Lock()
        # writes queued for the writing thread: action_ranks rows, and the latest row of each changed action
        self._q_lock = threading.Lock()
        self._q_ranks: list[list] = []
        self._q_actions: dict[str, tuple] = {}
        self._q_future: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tracetop-control-write")
        self.counts = {"reports": 0, "reports_refused": 0, "subscribers_refused": 0, "writes": 0,
                       "commands_withheld": 0}
        self._warned: set[str] = set()
        #: run -> its actions rank 0 can still poll (approved or sent): Push replies say whether any wait
        self._waiting: dict[str, set[str]] = {}
        self.profiles = profiles.Traces()  # profiling windows' traces on their way in
        self._q_profile: list[tuple[str, list]] = []  # ("chunk" | "trace", row) for the writing thread
        self._load()

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)
        self._cur.close()
        self._wcur.close()

    # ------------------------------------------------------------------ who is who
    def heard(self, batches: Iterable) -> None:
        """The writer committed these batches (its thread): note each hooks' start's run and rank."""
        now = self._clock_ns()
        for b in batches:
            if getattr(b.kind, "name", "") not in ("HEARTBEAT", "RUN_START"):
                continue
            col = b.columns.get("rank")
            if col is None or isinstance(col, tuple) or len(col) == 0:
                continue
            self.note_source(b.key, b.run_id, int(col[0]), now)

    def note_source(self, key: str, run_id: str, rank: int, first_ns: int) -> None:
        with self._sources_lock:
            known = self._sources.get(key)
            if known is not None:
                self._sources.move_to_end(key)
                return
            self._sources[key] = (run_id, rank, first_ns)
            while len(self._sources) > self.max_sources:
                self._sources.popitem(last=False)

    def _source(self, key: str) -> tuple[str, int, int] | None:
        """(run_id, rank, first heard ns) of a start; ("", -1, first_seen_ns) for one only the file's
        `sources` table knows (heard before a collector restart); None for a start never heard."""
        if not key:
            return None
        with self._sources_lock:
            known = self._sources.get(key)
        if known is not None:
            return known
        row = self._cur.execute("SELECT first_seen_ns FROM sources WHERE source_id = ?", [key]).fetchone()
        return ("", -1, int(row[0])) if row else None

    def _refuse_report(self, why: str, s: pb.CommandStatus) -> None:
        self.counts["reports_refused"] += 1
        if why not in self._warned:
            self._warned.add(why)
            log.warning("collector: a report for action %r of run %r as rank %d is not counted: %s (counted in "
                        "reports_refused; logged once)", s.command_id, s.run_id, s.rank, why)

    def _report_refusal(self, s: pb.CommandStatus, a: act.Action) -> str | None:
        if not 0 <= s.rank < max(1, a.ranks_expected):
            return f"rank outside the run's world size ({a.ranks_expected})"
        src = self._source(s.source_key)
        if src is None:
            return "its source_key is not a shipper start this collector heard (a report needs the rank's own)"
        run, rank, _ = src
        if run and (run != s.run_id or rank != s.rank):
            return "its source_key ships another run's or another rank's rows"
        return None

    def _for_predecessor(self, a: act.Action, source_key: str) -> bool:
        """True when the polling rank 0 is a start first heard after ``a`` was approved: a job
        restarted under the same run id, which must not receive it."""
        src = self._source(source_key)
        return bool(src is not None and a.approved_ns and src[2] > a.approved_ns)

    def _not_heard_yet(self, source_key: str) -> bool:
        """A rank 0 start that shipped nothing the collector committed yet: it is handed nothing
        until it is heard (then the predecessor check can tell whose command it is)."""
        return bool(source_key) and self._source(source_key) is None

    def _withhold(self, a: act.Action) -> None:
        self.counts["commands_withheld"] += 1
        a.state, a.done_ns, a.marked_lost = "lost", self._clock_ns(), True
        a.outcome = (f"{a.shown()} not sent: the job restarted under run id {a.run_id} after it was approved (rank 0 "
                     "is a new start); a command is never handed to a later job. Nothing was applied; propose it again")
        self._changed(a)

    # ------------------------------------------------------------------ writing, off the loop
    def _queue_write(self) -> Future:
        with self._q_lock:
            if self._q_future is None:
                self._q_future = self._pool.submit(self._write_queued)
            return self._q_future

    def _write_queued(self) -> None:
        with self._q_lock:
            ranks, self._q_ranks = self._q_ranks, []
            actions, self._q_actions = self._q_actions, {}
            prof, self._q_profile = self._q_profile, []
            self._q_future = None
        if not ranks and not actions and not prof:
            return
        cur = self._wcur
        try:
            cur.execute("BEGIN")
            if actions:
                cur.executemany("DELETE FROM actions WHERE action_id = ?", [[k] for k in actions])
                cur.executemany(f"INSERT INTO actions VALUES ({', '.join('?' * len(act.Action.COLUMNS))})",
                                [list(r) for r in actions.values()])
            if 0 < len(ranks) < 8:
                cur.executemany("INSERT INTO action_ranks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", ranks)
            elif ranks:  # one Arrow insert: executemany costs ~1 ms a row (16k reports: 18 s), this ~10 ms in all
                import pyarrow as pa

                cols = list(zip(*ranks))
                names = ["action_id", "run_id", "rank", "stage", "step", "message", "micro_batch", "micro_batches",
                         "reported_ns"]
                types = [pa.string(), pa.string(), pa.int32(), pa.string(), pa.int64(), pa.string(), pa.int32(),
                         pa.int32(), pa.int64()]
                table = pa.table([pa.array(c, t) for c, t in zip(cols, types)], names=names)
                cur.register("_tracetop_reports", table)
                try:
                    cur.execute("INSERT INTO action_ranks SELECT * FROM _tracetop_reports")
                finally:
                    cur.unregister("_tracetop_reports")
            profiles.write(cur, prof)
            cur.execute("COMMIT")
            self.counts["writes"] += 1
        except Exception:
            try:
                cur.execute("ROLLBACK")
            except Exception:
                pass
            log.exception("collector: writing %d action rows and %d rank reports failed", len(actions), len(ranks))

    def flush(self) -> None:
        """Wait until every queued change is in the file (tests, close)."""
        self._queue_write().result()

    # ------------------------------------------------------------------ what the file knows
    def _load(self) -> None:
        rows = self._cur.execute(f"SELECT {', '.join(act.Action.COLUMNS)} FROM actions").fetchall()
        for row in rows:
            d = dict(zip(act.Action.COLUMNS, row))
            a = act.Action(**d)
            self.actions[a.action_id] = a
            self._note_waiting(a)
            if a.action_id.isdigit():
                self._next_id = max(self._next_id, int(a.action_id) + 1)

    def runs(self) -> list[str]:
        return [r[0] for r in self._cur.execute("SELECT DISTINCT run_id FROM run_start ORDER BY 1").fetchall()]

    def shape(self, run_id: str) -> RunShape | None:
        row = self._cur.execute(
            "SELECT max(world_size), count(DISTINCT rank), max(dp), max(pp), max(zero_stage), max(micro_batch), "
            "max(micro_batches), any_value(ds_config_json) FROM run_start WHERE run_id = ?", [run_id]).fetchone()
        if row is None or row[0] is None:
            return None
        world, started, dp, pp, zero, mb, mbs, cfg = row
        offload = False
        try:
            zo = json.loads(cfg or "{}").get("zero_optimization", {}) or {}
            offload = (zo.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
        except (ValueError, AttributeError):
            pass
        per_rank = (mb or 0) * (mbs or 0)
        done = sorted((a for a in self.actions.values() if a.run_id == run_id and a.done_ns
                       and a.state in ("applied", "verified", "rolled_back")), key=lambda a: a.done_ns or 0)
        rebalance: tuple[int, ...] = ()
        relieved = -1
        for a in done:
            if a.kind == "micro_batch" and per_rank and per_rank % a.value == 0:
                mb, mbs = a.value, per_rank // a.value
            elif a.kind == "offload":
                offload = bool(a.value)
            elif a.kind == "rebalance":  # back to balanced (-1) leaves nothing in force
                rebalance, relieved = (tuple(a.value_list or ()), a.value) if a.value >= 0 else ((), -1)
        return RunShape(run_id, int(world), int(started), int(dp or 1), int(pp or 1), int(zero if zero is not None else -1),
                        int(mb or -1), int(mbs or -1), offload, rebalance, relieved)

    # ------------------------------------------------------------------ requests
    def propose(self, run_id: str, kind: str, value: int, *, by: str, rule: str = "manual", reason: str = "",
                expected: str = "", approve: bool = False, rollback_of: str | None = None,
                values: Sequence[int] = ()) -> act.Action:
        shape = self.shape(run_id)
        if shape is None:
            known = self.runs()
            raise ControlError(grpc.StatusCode.NOT_FOUND,
                               f"no run {run_id!r} in this collector (no RUN_START rows); it knows "
                               f"{known[:10] or 'no runs yet'}. Check --run, or wait for the run's first rows")
        if kind == "profile":  # a bad request, not a run that cannot take it
            why = profile_refusal(shape, int(value), tuple(int(v) for v in values))
            if why:
                raise ControlError(grpc.StatusCode.INVALID_ARGUMENT, why)
        why = None if kind == "profile" else refusal(shape, kind, int(value), values)
        if why:
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION, why)
        for other in self.actions.values():
            if other.run_id == run_id and other.state in act.OPEN and other.state != "proposed":
                raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"action {other.action_id} ({other.shown()}) is still {other.state} on run {run_id}; "
                                   "one change at a time: wait for its outcome (`tracetop actions`)")
        now = self._clock_ns()
        if len(values) > act.MAX_VALUES:
            raise ControlError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{kind}: {len(values)} values, at most {act.MAX_VALUES} (one per rank or replica)")
        previous = (shape.micro_batch if kind == "micro_batch" else int(shape.offload) if kind == "offload"
                    else shape.relieved if kind == "rebalance" else None)
        a = act.Action(str(self._next_id), run_id, kind, int(value), previous, rollback_of, "proposed", rule, reason,
                       expected, by, now, shape.world_size, updated_ns=now,
                       value_list=[int(v) for v in values] if values else None)
        self._next_id += 1
        self.actions[a.action_id] = a
        if approve:
            self._approve(a, by)
        else:
            self._changed(a)
        return a

    def approve(self, action_id: str, by: str) -> act.Action:
        a = self._get(action_id)
        if a.state != "proposed":
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"action {action_id} is {a.state}, not proposed: only a proposal can be approved")
        shape = self.shape(a.run_id) or _no_shape(a.run_id)
        why = (profile_refusal(shape, a.value, a.value_list or ()) if a.kind == "profile"
               else refusal(shape, a.kind, a.value, a.value_list or ()))
        if why:
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION, f"action {action_id} can no longer be sent: {why}")
        self._approve(a, by)
        return a

    def dismiss(self, action_id: str, by: str, reason: str = "") -> act.Action:
        a = self._get(action_id)
        if a.state != "proposed":
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"action {action_id} is {a.state}, not proposed: only a proposal can be rejected")
        a.state, a.done_ns = "dismissed", self._clock_ns()
        a.outcome = f"rejected by {by}" + (f": {reason}" if reason else "") + "; nothing sent"
        self._changed(a)
        return a

    def rollback(self, action_id: str, by: str, reason: str = "", rule: str = "manual") -> act.Action:
        a = self._get(action_id)
        if a.state not in ("applied", "verified"):
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"action {action_id} is {a.state}: only an applied action can be rolled back")
        if a.previous_value is None:
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION, f"action {action_id} does not know what it replaced")
        values = self._rebalance_before(a) if a.kind == "rebalance" else ()
        return self.propose(a.run_id, a.kind, a.previous_value, by=by, rule=rule, approve=True, rollback_of=a.action_id,
                            reason=reason or f"roll back action {action_id} ({a.shown()})",
                            expected=f"back to {a.kind}={a.previous_value}" + (f" {list(values)}" if values else ""),
                            values=values)

    def _rebalance_before(self, a: act.Action) -> tuple[int, ...]:
        """The samples per replica in force before rebalance ``a``: the one applied before it, else balanced."""
        earlier = [b for b in self.actions.values() if b.run_id == a.run_id and b.kind == "rebalance" and b.done_ns
                   and b.state in ("applied", "verified", "rolled_back") and (b.done_ns or 0) < (a.done_ns or 0)]
        last = max(earlier, key=lambda b: b.done_ns or 0, default=None)
        if last is not None and last.value >= 0 and last.value_list:
            return tuple(last.value_list)
        shape = self.shape(a.run_id)
        return (shape.samples_per_rank,) * shape.dp if shape is not None else ()

    def verified(self, action_id: str, text: str) -> None:
        a = self._get(action_id)
        if a.state == "applied":
            a.state, a.verification, a.verified_ns = "verified", text, self._clock_ns()
            self._changed(a)

    def record_cannot_fix(self, run_id: str, problem: str, reason: str) -> act.Action:
        """The controller gave up on a problem: a row of its own in `actions` (nothing sent)."""
        now = self._clock_ns()
        shape = self.shape(run_id)
        a = act.Action(str(self._next_id), run_id, problem, 0, None, None, "cannot_fix", problem, reason,
                       "", "controller", now, shape.world_size if shape else 0, done_ns=now, outcome=reason,
                       updated_ns=now)
        self._next_id += 1
        self.actions[a.action_id] = a
        self._changed(a)
        return a

    def _get(self, action_id: str) -> act.Action:
        a = self.actions.get(action_id)
        if a is None:
            raise ControlError(grpc.StatusCode.NOT_FOUND, f"no action {action_id!r} (see `tracetop actions`)")
        return a

    def _approve(self, a: act.Action, by: str) -> None:
        now = self._clock_ns()
        a.state, a.approved_by, a.approved_ns = "approved", by, now
        a.expires_ns = now + self.ttl_ns
        self._changed(a)
        self._dispatch(a)

    def _command(self, a: act.Action) -> pb.Command:
        return pb.Command(command_id=a.action_id, run_id=a.run_id, kind=act.KIND_CODES[a.kind], int_value=a.value,
                          reason=a.reason, issued_ns=a.approved_ns or 0, expires_ns=a.expires_ns or 0,
                          rollback_of=a.rollback_of or "", values=a.value_list or ())

    def _dispatch(self, a: act.Action, queues: set | None = None) -> None:
        queues = self.subscribers.get(a.run_id) if queues is None else queues
        if not queues:
            return  # sent when rank 0 subscribes (before it expires)
        cmd = self._command(a)
        for q in queues:
            q.put_nowait(cmd)
        if a.state == "approved":
            a.state, a.sent_ns = "sent", self._clock_ns()
            self._changed(a)

    def on_status(self, s: pb.CommandStatus) -> None:
        a = self.actions.get(s.command_id)
        if a is None or a.run_id != s.run_id:
            self._refuse_report("no such action of that run", s)
            return
        why = self._report_refusal(s, a)
        if why is not None:
            self._refuse_report(why, s)
            return
        self.counts["reports"] += 1
        stage = act.STAGES.get(int(s.stage)) or ("applied" if s.applied else "refused")
        now = self._clock_ns()
        r = act.RankReport(s.rank, stage, int(s.step), s.message, int(s.micro_batch), int(s.micro_batches), now)
        with self._q_lock:
            self._q_ranks.append([a.action_id, a.run_id, r.rank, r.stage, r.step, r.message, r.micro_batch,
                                  r.micro_batches, now])
        before = a.state
        act.report(a, r, s.applied, now)
        if a.state == "applied" and a.rollback_of and before != "applied":
            target = self.actions.get(a.rollback_of)
            if target is not None and target.state in ("applied", "verified"):
                target.state, target.verified_ns = "rolled_back", now
                target.verification = f"rolled back by action {a.action_id} at step {a.step}: {a.reason}"
                self._changed(target)
        self._changed(a)

    def sweep(self) -> list[act.Action]:
        """Mark lost what rank 0 did not receive before it expired."""
        now = self._clock_ns()
        lost = []
        for a in self.actions.values():
            if a.state in ("approved", "sent") and a.expires_ns and now > a.expires_ns + act.LOST_GRACE_NS:
                a.state, a.done_ns, a.marked_lost = "lost", now, True
                how = "sent to rank 0's subscription" if a.sent_ns else "rank 0 never subscribed"
                a.outcome = (f"{a.shown()} lost: {how}, but rank 0 did not report receiving it before it expired; "
                             "rank 0 hands no expired command to the ranks, so nothing was applied anywhere")
                self._changed(a)
                lost.append(a)
            elif a.state == "received" and a.expires_ns and now > a.expires_ns + self.ttl_ns:
                a.state, a.done_ns = "incomplete", now
                missing = sorted(set(range(a.ranks_expected)) - set(a.finals))
                a.outcome = (f"{a.shown()}: {len(a.finals)} of {a.ranks_expected} ranks reported; ranks "
                             f"{missing[:16]} never did (did the job end, or a rank die?)")
                self._changed(a)
        return lost

    def commands_waiting(self, run_id: str) -> bool:
        """Whether ``Poll`` would hand this run's rank 0 a command now (approved or sent, not yet
        received): what an ``Ingest.Push`` reply tells rank 0's hooks, which then poll at once."""
        return run_id in self._waiting

    def _note_waiting(self, a: act.Action) -> None:
        ids = self._waiting.get(a.run_id)
        if a.state in ("approved", "sent"):
            if ids is None:
                self._waiting[a.run_id] = {a.action_id}
            else:
                ids.add(a.action_id)
        elif ids is not None:
            ids.discard(a.action_id)
            if not ids:
                del self._waiting[a.run_id]

    def _changed(self, a: act.Action) -> None:
        self._note_waiting(a)
        a.updated_ns = self._clock_ns()
        with self._q_lock:
            self._q_actions[a.action_id] = tuple(a.row())
        self._queue_write()
        for fn in self.listeners:
            try:
                fn(a)
            except Exception:
                log.exception("collector: action listener failed")

    # ------------------------------------------------------------------ gRPC
    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext):
        q: asyncio.Queue = asyncio.Queue()
        run = request.run_id
        if len(self.subscribers.get(run, ())) >= MAX_SUBSCRIBERS_PER_RUN:
            self.counts["subscribers_refused"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"run {run!r} already has {MAX_SUBSCRIBERS_PER_RUN} command streams open; rank 0 "
                                "needs one (its hooks use Poll): close the others")
        # what is waiting for this run (approved while nobody listened, or sent to a stream now gone)
        for a in sorted(self.actions.values(), key=lambda a: int(a.action_id) if a.action_id.isdigit() else 0):
            if a.run_id == run and a.state in ("approved", "sent"):
                if self._for_predecessor(a, request.source_key):
                    self._withhold(a)
                    continue
                self._dispatch(a, {q})
        self.subscribers[run].add(q)
        try:
            while True:
                cmd = await q.get()
                await context.write(cmd)
        finally:
            self.subscribers[run].discard(q)

    async def Poll(self, request: pb.SubscribeRequest, context) -> pb.CommandBatch:
        batch = pb.CommandBatch()
        if self._not_heard_yet(request.source_key):
            return batch
        for a in sorted(self.actions.values(), key=lambda a: int(a.action_id) if a.action_id.isdigit() else 0):
            if a.run_id == request.run_id and a.state in ("approved", "sent"):
                if self._for_predecessor(a, request.source_key):
                    self._withhold(a)
                    continue
                batch.commands.append(self._command(a))
                if a.state == "approved":
                    a.state, a.sent_ns = "sent", self._clock_ns()
                    self._changed(a)
        return batch

    async def Report(self, request: pb.CommandStatus, context) -> pb.StatusAck:
        self.on_status(request)
        # answered once it is in the file (the caller waits; the loop does not: one write serves
        # every report that came meanwhile)
        await asyncio.wrap_future(self._queue_write())
        return pb.StatusAck()

    def on_profile(self, c: pb.ProfileChunk) -> None:
        """One piece of a profiling window's trace (``Control.Profile``); raises ControlError."""
        a = self.actions.get(c.command_id)
        if a is None or a.run_id != c.run_id or a.kind != "profile":
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"no profiling action {c.command_id!r} on run {c.run_id!r}: a trace is taken only for one")
        if int(c.rank) not in (a.value_list or ()):
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"action {a.action_id} did not name rank {c.rank}; its ranks are {a.value_list}")
        src = self._source(c.source_key)
        if src is None or (src[0] and (src[0] != c.run_id or src[1] != c.rank)):
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               "its source_key is not this rank's shipper start (a trace needs the rank's own)")
        rows = self.profiles.take(c, self._clock_ns())
        with self._q_lock:
            self._q_profile.extend(rows)

    async def Profile(self, request: pb.ProfileChunk, context) -> pb.StatusAck:
        try:
            self.on_profile(request)
        except ControlError as e:
            await context.abort(e.code, e.message)
        await asyncio.wrap_future(self._queue_write())
        return pb.StatusAck()

    async def Submit(self, request: pb.ControlRequest, context: grpc.aio.ServicerContext) -> pb.ControlReply:
        by = request.by or "person"
        try:
            if request.op == pb.PROPOSE:
                kind = {v: k for k, v in act.KIND_CODES.items()}.get(int(request.kind))
                if kind is None:
                    raise ControlError(grpc.StatusCode.INVALID_ARGUMENT,
                                       "PROPOSE needs kind SET_MICRO_BATCH, OFFLOAD_OPTIMIZER, REBALANCE or PROFILE")
                a = self.propose(request.run_id, kind, int(request.int_value), by=by, rule=request.rule or "manual",
                                 reason=request.reason, expected=request.expected, approve=request.approve,
                                 values=tuple(request.values))
            elif request.op == pb.APPROVE:
                a = self.approve(request.action_id, by)
            elif request.op == pb.REJECT:
                a = self.dismiss(request.action_id, by, request.reason)
            elif request.op == pb.ROLLBACK:
                a = self.rollback(request.action_id, by, request.reason)
            else:
                raise ControlError(grpc.StatusCode.INVALID_ARGUMENT, "op must be PROPOSE, APPROVE, REJECT or ROLLBACK")
        except ControlError as e:
            await context.abort(e.code, e.message)
        await asyncio.wrap_future(self._queue_write())  # the file shows it when the caller hears of it
        return pb.ControlReply(action_id=a.action_id, state=a.state, message=a.outcome or a.reason)


def _no_shape(run_id: str) -> RunShape:
    return RunShape(run_id, 0, 0, 1, 1, -1, -1, -1, False)


class ControlServicer(pb_grpc.ControlServicer):
    """Binds the generated servicer to one ControlService."""

    def __init__(self, service: ControlService) -> None:
        self.s = service

    async def Subscribe(self, request, context):  # noqa: N802 (the generated names)
        await self.s.Subscribe(request, context)

    async def Report(self, request, context):  # noqa: N802
        return await self.s.Report(request, context)

    async def Poll(self, request, context):  # noqa: N802
        return await self.s.Poll(request, context)

    async def Submit(self, request, context):  # noqa: N802
        return await self.s.Submit(request, context)

    async def Profile(self, request, context):  # noqa: N802
        return await self.s.Profile(request, context)
