"""Rank 0's link to the collector's Control service: the threads of the command path.

Two threads, both started only when needed (none before the first command boundary), both off the
training thread:

- the subscriber (``tracetop-commands``, rank 0 only): ``Control.Poll`` (a unary call, no stream
  held open), each command checked (its id, its size, its expiry, the test seam that drops it) and
  put in the inbox the command boundary reads (trainer_hooks/commands.py). When it polls: the
  collector says in every ``Ingest.Push`` reply to rank 0's shipper whether commands wait for the
  run (``PushReply.commands_waiting``); while replies say so (one within ``TOLD_FRESH_S``), rank 0
  polls as soon as one says true and otherwise only every ``IDLE_POLL_S`` (60 s: nothing is stranded
  if a reply were missed). A receiver that does not say (an older collector, a node agent), or an
  explicit ``TRACETOP_COMMAND_POLL_S``, keeps the poll every ``poll_s`` (default 5 s). A command
  then reaches rank 0 within one shipment interval (``TRACETOP_FLUSH_S``, 5 s; 1 s while the run is
  watched) plus the Push's commit, as it did within one 5 s poll; each poll cost the trainer process
  ~1 ms of CPU in gRPC (docs/benchmarks.md);
- the reporter (``tracetop-reports``, any rank that has something to say): each outcome
  (``Control.Report``) sent in order from an outbox, retried, never blocking the step that made it.

The channel (and its credentials, the same as the shipper's) is made on first use and shared by
both threads and by a profiling window's upload (trainer_hooks/profiling.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tracetop import env as tenv

log = logging.getLogger("trainer_hooks")

DEFAULT_POLL_S = 5.0
#: while Push replies say whether commands wait: the poll when none has said so for this long
IDLE_POLL_S = 60.0
#: a Push reply that said so within this long is trusted (replies come every shipment: 5 s or less)
TOLD_FRESH_S = 30.0
#: the least time between two polls a reply asked for (the flag stays up until rank 0's "received" lands)
MIN_GAP_S = 0.5


def poll_due(now: float, last_poll: float, wait_s: float, asked: bool, told_at: float | None,
             explicit: bool) -> bool:
    """Whether rank 0 polls now (pure). ``wait_s``: the poll interval in force (``poll_s``, or a
    failure's backoff); ``asked``: a Push reply said commands wait since the last poll;
    ``told_at``: when a reply last said either way (None: never); ``explicit``: the poll interval
    was set (TRACETOP_COMMAND_POLL_S), so it is kept whatever replies say."""
    since = now - last_poll
    if since >= wait_s and (explicit or told_at is None or now - told_at > TOLD_FRESH_S):
        return True  # the regular poll: a receiver that does not say, or one not heard lately
    if asked and since >= MIN_GAP_S:
        return True
    return since >= max(wait_s, IDLE_POLL_S)


class ControlLink:
    """The subscriber and reporter threads, and the channel they share (see the module docstring).

    ``tracer``: the rank's Tracer (its run id, rank, recorder, shipper, batch shape);
    ``kinds``: the wire CommandKind number -> trainer-side key map (for the drop seam's
    ``KEY=VALUE``); ``max_values``: the longest list argument a command may carry; ``stats``: the
    command bus's counters, updated here (``received``, ``dropped``, ``reports_sent``,
    ``reports_failed``)."""

    def __init__(self, tracer: Any, *, kinds: dict[int, str], max_values: int, stats: dict[str, int],
                 endpoint: str | None = None, drop: str | None = None,
                 channel_factory: Callable[[str], Any] | None = None,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.t = tracer
        self.kinds = kinds
        self.max_values = max_values
        self.stats = stats
        self.poll_s = poll_s_from_env()
        self.poll_explicit = bool(tenv.get(tenv.TRACETOP_COMMAND_POLL_S))
        self.poke = threading.Event()  # a Push reply said commands wait (or close())
        self.asked = False
        self.told_at: float | None = None  # monotonic time of the last Push reply that said either way
        self.endpoint = endpoint
        self.drop = drop if drop is not None else (tenv.get(tenv.TRACETOP_TEST_DROP_COMMANDS) or "")
        self.channel_factory = channel_factory
        self.clock_ns = clock_ns
        self.inbox: collections.deque = collections.deque()  # commands taken, for rank 0's next boundary
        self.seen: set[int] = set()
        self.auth: Any = None
        self.subscriber: threading.Thread | None = None
        self.reporter: threading.Thread | None = None
        self.outbox: collections.deque = collections.deque()
        self.sent = threading.Condition()  # notified by the reporter as each report is done with (close waits on it)
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.chan: Any = None

    # ------------------------------------------------------------------ the channel
    def target(self) -> str:
        """Where commands come from, checked when the channel is made: a unix socket (its folder, its
        listener's uid) must be ours or root's before it sees the token or hands a command
        (tracetop/wire/local.py)."""
        from trainer_hooks.tracer import trusted_endpoint

        target = self.endpoint or getattr(self.t, "endpoint", None) or tenv.endpoint()
        return trusted_endpoint(target, getattr(self.t, "rank", -1))

    def channel(self) -> Any:
        """The channel to the Control service, made on first use."""
        if self.chan is None:
            if self.channel_factory is not None:
                self.chan = self.channel_factory(self.target())
            else:
                from tracetop.wire.auth import ClientAuth

                # TRACETOP_TOKEN_FILE / TRACETOP_TLS_*: the same credentials the shipper presents
                self.auth = ClientAuth.from_options()
                self.chan = self.auth.channel(self.target())
        return self.chan

    def source_key(self) -> str:
        """This rank's shipper start (its source id and epoch, as the collector keys it): the
        collector counts a report, and hands a command, only to a start it heard ship this run's rows."""
        from tracetop.wire.codec import source_key

        sh = getattr(self.t, "shipper", None)
        sid, epoch = getattr(sh, "source_id", ""), getattr(sh, "epoch", 0)
        return source_key(sid, int(epoch or 0)) if sid else ""

    def metadata(self) -> tuple:
        auth = self.auth
        return tuple(auth.metadata()) if auth is not None else ()

    # ------------------------------------------------------------------ the subscriber
    def start_subscriber(self) -> None:
        listen = getattr(getattr(self.t, "shipper", None), "on_commands_waiting", None)
        if listen is not None:
            listen(self.on_commands_waiting)
        self.subscriber = threading.Thread(target=self._run_subscriber, name="tracetop-commands", daemon=True)
        self.subscriber.start()

    def on_commands_waiting(self, waiting: bool) -> None:
        """The shipper's sender thread: a Push reply said whether commands wait for this run."""
        self.told_at = time.monotonic()
        if waiting:
            self.asked = True
            self.poke.set()

    def _run_subscriber(self) -> None:
        """Rank 0: ``Control.Poll`` when :func:`poll_due` says (a unary call; between calls the
        thread sleeps in a plain wait: no gRPC stream held open, whose polling would cost CPU all
        run long)."""
        import grpc

        from tracetop.wire import tracetop_pb2 as pb
        from tracetop.wire import tracetop_pb2_grpc as pb_grpc

        wait_s = self.poll_s
        stub: Any = None
        last_poll = time.monotonic()
        while True:
            self.poke.wait(self.poll_s)  # a look every poll_s; a reply that says commands wait wakes it at once
            self.poke.clear()
            if self.stopping.is_set():
                return
            now = time.monotonic()
            if not poll_due(now, last_poll, wait_s, self.asked, self.told_at, self.poll_explicit):
                continue
            last_poll, self.asked = now, False
            self.stats["polls"] += 1
            try:
                if stub is None:  # one stub for the run (made at each poll, it cost a few calls' worth)
                    stub = pb_grpc.ControlStub(self.channel())
                batch = stub.Poll(pb.SubscribeRequest(run_id=self.t.run_id, rank=self.t.rank,
                                                      source_key=self.source_key()), timeout=10,
                                  metadata=self.metadata())
                for cmd in batch.commands:
                    self.take(cmd)
                wait_s = self.poll_s
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                wait_s = min(30.0, max(self.poll_s, wait_s * 2))
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    wait_s = 60.0
                    if "unimplemented" not in self.t.recorder.warned:
                        self.t.recorder.warned.add("unimplemented")
                        log.warning("trainer_hooks: %s has no Control service (an agent older than the control "
                                    "relay?): this run receives no commands", self.target())
            except Exception as e:
                self.t.recorder.hook_error("commands subscriber", e)

    def take(self, cmd: Any) -> None:
        """Rank 0's subscriber: one command from the collector, into the inbox (or refused, said)."""
        try:
            action_id = int(cmd.command_id)
        except ValueError:
            self.report(cmd.command_id, False, -1, "command id is not a number; not applied")
            return
        if action_id in self.seen:
            return  # resent after a reconnect
        if len(cmd.values) > self.max_values:
            self.seen.add(action_id)
            self.report(cmd.command_id, False, -1, f"{len(cmd.values)} values, at most {self.max_values}; not applied")
            return
        if self.drop and self.matches_drop(cmd):
            self.stats["dropped"] += 1  # the test seam: lost between the collector and rank 0
            return
        self.seen.add(action_id)
        if cmd.expires_ns and self.clock_ns() > cmd.expires_ns:
            self.report(cmd.command_id, False, -1, "arrived at rank 0 after it expired; not applied")
            return
        self.stats["received"] += 1
        self.inbox.append(cmd)
        self.report(cmd.command_id, False, -1, "received by rank 0; applied at the next boundary", stage=1)

    def matches_drop(self, cmd: Any) -> bool:
        """TRACETOP_TEST_DROP_COMMANDS: ``all``, or ``KEY=VALUE`` entries, comma-separated."""
        key = self.kinds.get(int(cmd.kind), "")
        value = ("on" if cmd.int_value else "off") if key == "offload" else str(cmd.int_value)
        for item in self.drop.split(","):
            item = item.strip()
            if item in ("all", "1") or item == f"{key}={value}":
                return True
        return False

    # ------------------------------------------------------------------ the reporter
    def report(self, command_id: str, applied: bool, step: int, message: str, stage: int = 0) -> None:
        """Queue one outcome for the reporter thread (started on the first); returns at once."""
        t = self.t
        self.outbox.append((command_id, applied, step, message, stage, int(t.micro_batch), int(t.micro_batches)))
        if self.reporter is None:
            self.reporter = threading.Thread(target=self._run_reporter, name="tracetop-reports", daemon=True)
            self.reporter.start()
        self.wake.set()

    def _run_reporter(self) -> None:
        from tracetop.wire import tracetop_pb2 as pb
        from tracetop.wire import tracetop_pb2_grpc as pb_grpc

        while True:
            self.wake.wait()  # no timer: report() and close() set it (an idle reporter never wakes)
            self.wake.clear()
            while self.outbox:
                cid, applied, step, message, stage, mb, mbs = self.outbox[0]
                status = pb.CommandStatus(command_id=cid, run_id=self.t.run_id, rank=self.t.rank, applied=applied,
                                          source_key=self.source_key(),
                                          step=step, message=message, stage=stage, micro_batch=mb, micro_batches=mbs)
                for attempt in range(5):
                    try:
                        pb_grpc.ControlStub(self.channel()).Report(status, timeout=10, metadata=self.metadata())
                        self.stats["reports_sent"] += 1
                        break
                    except Exception as e:
                        # the last try, or the close's deadline is past: the report is lost, counted
                        if attempt == 4 or self.stopping.wait(0.5 * (attempt + 1)):
                            self.stats["reports_failed"] += 1
                            self.t.recorder.hook_error("commands report", e)
                            break
                self.outbox.popleft()
                with self.sent:
                    self.sent.notify_all()
            if self.stopping.is_set():
                return

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads after the last reports are out, all of it within ``timeout_s`` (the
        tracer's close passes what its deadline leaves). Woken by the reporter as each report is
        done with, not by a timer: it returns as soon as the last one is."""
        deadline = time.monotonic() + timeout_s
        reporter = self.reporter
        if reporter is not None:
            self.wake.set()
            with self.sent:
                self.sent.wait_for(lambda: not self.outbox or not reporter.is_alive(),
                                   max(0.0, deadline - time.monotonic()))
        self.stopping.set()
        self.wake.set()
        self.poke.set()
        for th in (self.subscriber, reporter):
            if th is not None:
                th.join(timeout=min(2.0, max(0.0, deadline - time.monotonic())))
        if self.chan is not None:
            try:
                self.chan.close()
            except Exception:
                pass


def poll_s_from_env() -> float:
    """TRACETOP_COMMAND_POLL_S: seconds between rank 0's polls (a positive number; setup error else)."""
    raw = tenv.get(tenv.TRACETOP_COMMAND_POLL_S, str(DEFAULT_POLL_S)) or ""
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from trainer_hooks.identity import SetupError

        raise SetupError(f"trainer_hooks: {tenv.TRACETOP_COMMAND_POLL_S}={raw!r}: give a positive number of seconds, "
                         f"e.g. {DEFAULT_POLL_S:g}")
    return value
