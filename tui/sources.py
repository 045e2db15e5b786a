"""Where the TUI's snapshots come from: one small protocol, two real sources.

- FileSource(path): a finished run's DuckDB file, opened read-only (never while a collector
  holds it: DuckDB refuses, and we say so), any step on demand (the replay scrubber).
- CollectorSource(addr): a running collector's Query.Watch stream (snapshots at a rate),
  Query.Sql for a rank's drill-down, and Control.Submit to approve or reject a proposed action
  (with the control token where the collector demands one). The TUI never opens a file a
  collector holds.

Both build snapshots with collector/query/snapshot.py (the one definition); nothing here imports the
collector. Every failure a person can act on is a SourceError with a title, what happened and
what to do, which the app shows as a screen (harlequin's domain errors with a title).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from collector.query import snapshot as snap
from tracetop.errors import TracetopError

if TYPE_CHECKING:
    import duckdb


class SourceError(TracetopError):
    """A condition the person at the terminal must act on."""

    def __init__(self, title: str, message: str, hint: str) -> None:
        super().__init__(f"{title}: {message}")
        self.title, self.message, self.hint = title, message, hint


def as_source_error(e: Exception, hint: str) -> SourceError:
    """`e` as the screen shows it: a SourceError as it is, anything else as an unexpected error with `hint`."""
    return e if isinstance(e, SourceError) else SourceError("unexpected error", f"{type(e).__name__}: {e}", hint)


class Decision(NamedTuple):
    """The collector's answer to an approve / reject: the action and its state after it."""

    action_id: str
    state: str
    message: str


#: What a person may decide about a proposal from the TUI, and the Control op each sends.
DECISIONS = ("approve", "reject")


def _read_only(what: str) -> SourceError:
    return SourceError("read-only", f"{what}: nothing here can send a command to a run",
                       "approve or reject on the live run: tracetop ui --collector ADDR "
                       "(or tracetop control --collector ADDR approve|reject ID)")


class Source(Protocol):
    live: bool
    description: str
    run_id: str

    @property
    def is_open(self) -> bool:
        """True from a successful open() to close(): the app opens a source only when it is not."""

    def open(self) -> None:
        """Connect / open and pick the run; raises SourceError."""

    def snapshot_at(self, step: int | None) -> snap.Snapshot:
        """The run at `step` (None: latest complete step)."""

    def watch(self, interval_s: float, stop: threading.Event) -> Iterator[snap.Snapshot]:
        """Snapshots as they come (live sources); raises SourceError when the source goes away."""

    def rank_detail(self, rank: int, step: int) -> dict:
        """{"steps": table, "collectives": table} of one rank over the recent steps."""

    def decide(self, decision: str, action_id: str, reason: str = "") -> Decision:
        """Approve or reject a proposed action (DECISIONS); raises SourceError with the refusal."""

    def close(self) -> None: ...


# ---- after the run: a file ----------------------------------------------------------------------

class FileSource:
    """Read-only DuckDB on a finished run's file."""

    live = False

    def __init__(self, path: str | Path, run_id: str | None = None) -> None:
        self.path = Path(path)
        self.run_id = run_id or ""
        self.description = self.path.name  # the name, not the full path: screenshots stay the same anywhere
        self.con: duckdb.DuckDBPyConnection | None = None
        self._lock = threading.Lock()
        self._verdict: str | None = None  # the finished run's verdict, worked out at the first snapshot

    @property
    def is_open(self) -> bool:
        return self.con is not None

    def open(self) -> None:
        import duckdb

        if not self.path.exists():
            raise SourceError("no such file", f"{self.path} does not exist",
                              "give the DuckDB file a collector wrote (tracetop collector --db FILE)")
        try:
            self.con = duckdb.connect(str(self.path), read_only=True, config={"enable_external_access": False})
        except duckdb.IOException as e:
            first = str(e).splitlines()[0]
            if "lock" in first.lower():
                pid = first.split("PID")[-1].strip(" )") if "PID" in first else "?"
                raise SourceError(
                    "file held by a running collector",
                    f"{self.path} is open for writing by another process (PID {pid}); DuckDB lets no "
                    "second process read it meanwhile",
                    "watch the run live through that collector: tracetop ui --collector ADDR "
                    "(or open the file once the collector has stopped)",
                ) from e
            raise SourceError("cannot open the file", f"{self.path}: {first}",
                              "check the path and that it is a DuckDB file") from e
        except duckdb.Error as e:
            raise SourceError("not a DuckDB file", f"{self.path}: {str(e).splitlines()[0]}",
                              "give the .duckdb file a tracetop collector wrote") from e
        tables = {r[0] for r in self.con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "schema_meta" not in tables:
            self.close()
            raise SourceError("not a tracetop file", f"{self.path} has no schema_meta table",
                              "give the .duckdb file a tracetop collector wrote")
        version = int(self.con.execute("SELECT max(version) FROM schema_meta").fetchall()[0][0] or 0)
        if version > snap.MAX_STORE_VERSION:
            self.close()
            raise SourceError(
                "file of a newer schema",
                f"{self.path} has schema version {version}; this tracetop reads up to {snap.MAX_STORE_VERSION}",
                "upgrade tracetop (pip install -U tracetop) to read it",
            )
        runs = [r[0] for r in self.con.execute(snap.RUNS_SQL).fetchall()]
        if not runs:
            self.close()
            raise SourceError("no run in the file", f"{self.path} holds no run_start rows",
                              "was any rank's hook pointed at this collector? (TRACETOP_ENDPOINT)")
        if not self.run_id:
            self.run_id = runs[-1]
        elif self.run_id not in runs:
            self.close()
            raise SourceError("unknown run", f"run {self.run_id!r} is not in {self.path}",
                              f"runs in this file: {', '.join(runs[-10:])}; pick one with --run RUN")

    def snapshot_at(self, step: int | None) -> snap.Snapshot:
        with self._lock:
            try:
                s = snap.build(self.con, self.run_id, step=step, source="file")
            except snap.SnapshotError as e:
                raise SourceError("unknown run", str(e), "pick a run with --run RUN") from e
            if self._verdict is None:
                self._verdict = _verdict_text(self.con, self.run_id)
            return snap.Snapshot({**s.header, "verdict": self._verdict}, s.tables)

    def watch(self, interval_s: float, stop: threading.Event) -> Iterator[snap.Snapshot]:
        yield self.snapshot_at(None)

    def rank_detail(self, rank: int, step: int) -> dict:
        with self._lock:
            return snap.rank_detail(self.con, self.run_id, rank, step)

    def decide(self, decision: str, action_id: str, reason: str = "") -> Decision:
        raise _read_only(f"{self.description} is a finished run's file, opened read-only")

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None


# ---- live: a collector --------------------------------------------------------------------------

def _verdict_text(con, run_id: str) -> str:
    """The run's verdict paragraph (collector/query/verdict.py), or why there is none."""
    from collector.query import verdict

    try:
        return verdict.render(verdict.verdict_of(con, run_id))
    except Exception as e:  # a file too old or odd for the verdict's SQL: the rest of the TUI still works
        return f"verdict: none ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


class CollectorSource:
    """A running collector, through Query.Watch and Query.Sql only."""

    live = True

    def __init__(self, addr: str, run_id: str | None = None, *, connect_timeout_s: float = 3.0, auth=None,
                 control_token: str | None = None, by: str | None = None) -> None:
        """auth: tracetop.wire.auth.ClientAuth (TLS, and the token for Watch / Sql); control_token:
        the token Control.Submit presents (a collector with --control-token-file takes approvals
        only with it; it also grants queries, so alone it serves for both); by: who decides
        (default person:$USER)."""
        from tracetop.wire.auth import HEADER, ClientAuth

        self.addr = addr
        self.auth = auth or ClientAuth()  # TLS and a bearer token for a collector that demands them
        self.metadata = tuple(self.auth.metadata())
        self.control_token = control_token
        if control_token and not self.metadata:
            self.metadata = ((HEADER, "Bearer " + control_token),)
        self.control_metadata = ((HEADER, "Bearer " + control_token),) if control_token else self.metadata
        self.by = by or f"person:{_user()}"
        self.run_id = run_id or ""
        self.description = addr
        self.connect_timeout_s = connect_timeout_s
        self.channel = None
        self._call = None

    @property
    def is_open(self) -> bool:
        return self.channel is not None

    def open(self) -> None:
        import grpc

        from tracetop.wire import tracetop_pb2_grpc as pb_grpc

        self.channel = self.auth.channel(self.addr, options=[("grpc.max_receive_message_length", 256 << 20)])
        ready = grpc.channel_ready_future(self.channel)
        try:
            ready.result(timeout=self.connect_timeout_s)
        except grpc.FutureTimeoutError:
            ready.cancel()
            _await_connectivity_poll_end(self.channel)
            self.close()
            raise SourceError(
                "nothing answers",
                f"no collector answers at {self.addr} (waited {self.connect_timeout_s:.0f} s)",
                "start one (tracetop collector --db run.duckdb --listen ADDR), point the TUI at the right "
                "one (tracetop ui --collector ADDR, or TRACETOP_COLLECTOR=ADDR), or open a finished run's "
                "file (tracetop ui FILE.duckdb)",
            ) from None
        self.stub = pb_grpc.QueryStub(self.channel)

    def _error(self, e) -> SourceError:
        import grpc

        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return SourceError("not allowed", f"the collector at {self.addr} refused: {details}",
                               "give its token: tracetop ui --collector ADDR --token-file FILE (or TRACETOP_TOKEN_FILE), "
                               "and --tls-ca PEM if it serves TLS")
        if code == grpc.StatusCode.NOT_FOUND:
            return SourceError("unknown run", details, "pick a run with --run RUN (or leave it out for the newest)")
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return SourceError("collector too old", f"the collector at {self.addr} has no Query.Watch ({details})",
                               "upgrade the collector to this tracetop's version")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            return SourceError("collector went away", f"{self.addr}: {details}",
                               "waiting for it to come back (retrying); q quits")
        return SourceError("collector error", f"{self.addr}: {code.name if code else ''} {details}",
                           "see the collector's log")

    def watch(self, interval_s: float, stop: threading.Event) -> Iterator[snap.Snapshot]:
        import grpc

        from tracetop.wire import tracetop_pb2 as pb

        call = self._call = self.stub.Watch(pb.WatchRequest(run_id=self.run_id, interval_s=interval_s),
                                            metadata=self.metadata)
        try:
            for msg in call:
                s = snap.decode(msg.arrow_ipc)
                if s.header.get("run_id") and not self.run_id:
                    self.run_id = s.header["run_id"]
                yield s
                if stop.is_set():
                    break
        except grpc.RpcError as e:
            if stop.is_set():
                return
            raise self._error(e) from None
        finally:
            call.cancel()

    def snapshot_at(self, step: int | None) -> snap.Snapshot:
        for s in self.watch(1.0, threading.Event()):
            return s
        raise SourceError("collector went away", f"{self.addr}: the Watch stream ended", "retrying; q quits")

    def sql(self, text: str):
        import grpc

        from tracetop.wire import tracetop_pb2 as pb

        try:
            reply = self.stub.Sql(pb.QueryRequest(sql=text), timeout=30, metadata=self.metadata)
        except grpc.RpcError as e:
            raise self._error(e) from None
        return snap.from_ipc(reply.arrow_ipc)

    def rank_detail(self, rank: int, step: int) -> dict:
        params = {"run": self.run_id, "rank": int(rank), "step": int(step),
                  "lo": max(int(step) - snap.DEFAULT_WINDOW_STEPS + 1, 0)}
        return {"steps": self.sql(snap.inline(snap.RANK_DETAIL_SQL, params)),
                "collectives": self.sql(snap.inline(snap.RANK_COLLECTIVES_SQL, params))}

    def decide(self, decision: str, action_id: str, reason: str = "") -> Decision:
        """Control.Submit(APPROVE | REJECT) of `action_id`; the collector refuses at once, with the
        reason, what it cannot do (no control token, not proposed any more, an unknown id)."""
        import grpc

        from tracetop.wire import tracetop_pb2 as pb
        from tracetop.wire import tracetop_pb2_grpc as pb_grpc

        if decision not in DECISIONS:
            raise ValueError(f"decision {decision!r}: one of {DECISIONS}")
        if self.channel is None:
            raise SourceError("collector went away", f"{self.addr}: not connected", "retrying; try again in a moment")
        op = pb.APPROVE if decision == "approve" else pb.REJECT
        req = pb.ControlRequest(op=op, action_id=str(action_id), by=self.by,
                                reason=reason or f"{decision}d in the TUI")
        try:
            reply = pb_grpc.ControlStub(self.channel).Submit(req, timeout=15, metadata=self.control_metadata)
        except grpc.RpcError as e:
            raise self._control_error(e, decision, str(action_id)) from None
        return Decision(reply.action_id, reply.state, reply.message)

    def _control_error(self, e, decision: str, action_id: str) -> SourceError:
        import grpc

        code, details = e.code(), e.details()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            title = "control token refused" if self.control_token else "no control token"
            return SourceError(title, f"the collector at {self.addr} refused to {decision} action {action_id}: {details}",
                               "open the TUI with the collector's control token: tracetop ui --collector ADDR "
                               f"--control-token-file FILE (or {_control_env()}); nothing was sent")
        if code == grpc.StatusCode.NOT_FOUND:
            return SourceError("unknown action", details, "the Alerts & actions screen (7) lists the run's actions")
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return SourceError(f"cannot {decision}", details, "nothing was sent; the actions table shows its state now")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            return SourceError("collector went away", f"{self.addr}: {details}",
                               f"the {decision} may not have reached it: check the actions table once it is back")
        return SourceError("collector error", f"{self.addr}: {code.name if code else ''} {details}",
                           "see the collector's log")

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def _control_env() -> str:
    from tracetop import env

    return env.TRACETOP_CONTROL_TOKEN_FILE


def _await_connectivity_poll_end(channel, timeout_s: float = 2.0) -> None:
    """While a ready-future listens, grpcio polls the channel's connectivity on a thread of its own
    (a 0.2 s watch at a time); a channel closed under that watch raises "Cannot monitor channel
    state: Channel closed!" in the thread, which a user sees printed over the TUI (grpcio 1.85,
    seen in tests/tui/test_app.py::test_error_screens). Once the future is cancelled nobody
    listens, and the poll stops at the end of its watch: wait for that, at most ``timeout_s``."""
    import time

    state = getattr(channel, "_connectivity_state", None)  # grpc._channel.Channel's; absent: nothing to wait for
    deadline = time.monotonic() + timeout_s
    while getattr(state, "polling", False) and time.monotonic() < deadline:
        time.sleep(0.02)

