"""The shipper: the one client every producer uses to get events to a collector (or an agent).

Three promises (DESIGN §4):

* **The caller never waits.** ``record()`` appends a tuple to a bounded per-kind deque under a
  lock that is only ever held for an append or a swap; no protobuf, no I/O, no allocation beyond
  the tuple. When a kind's buffer is full the oldest rows are dropped and counted.
* **Nothing is lost silently.** A flusher thread turns buffered rows into columnar batches
  (vectorised, a few large numpy operations per batch), numbers them per source (``seq``), and
  keeps each one until the receiver acks it (cumulative acks). After a reconnect everything
  unacked is resent; the receiver drops duplicates. Every drop goes through one ledger
  (``tracetop/wire/ledger.py``, which lists the reasons) and becomes a GAP row that is itself
  shipped, with the same counts in ``stats()``.
* **Bounded memory, optional disk spool.** Unacked batches are bounded by ``max_unacked_bytes``
  (oldest own batches dropped first, with a gap row). With ``spool_dir`` every batch is written
  to disk before it counts as accepted (``forward`` returns only then: the agent acks hooks on
  that), survives a kill -9, and is replayed on the next start.

Parts: ``intake.py`` (what producers recorded, not yet sealed: plain state), ``sealer.py`` (rows
into numbered batches; every loss into the ledger), ``outbox.py`` (the unacked book, limbo, resend
order: plain state), ``spool.py`` (the disk spool), ``transport.py`` (the one I/O seam: gRPC
``Ingest.Push``/``Ingest.Stream`` by default, ``MemoryTransport`` for tests and in-process use).
This module keeps the two threads (flusher, sender: one sender loop for every transport), the
receiver's freshness request (``ship_interval_s``) and the stats. ``Sink`` is the contract a
producer (the hooks' Tracer, the agent's relay) holds: ``Shipper`` and ``NullShipper`` fulfil it.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tracetop import env
from tracetop.events import Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import source_key
from tracetop.wire.intake import Intake
from tracetop.wire.ledger import DropLedger
from tracetop.wire.outbox import Outbox
from tracetop.wire.pacing import Pacing
from tracetop.wire.sealer import BATCH_BYTES, MAX_BATCH_ROWS, Sealer
from tracetop.wire.spool import Spool, SpoolWriteError
from tracetop.wire.transport import (
    MAX_MESSAGE_BYTES,
    Disconnected,
    GrpcTransport,
    MemoryTransport,
    Rejected,
    SendTarget,
    SendTransport,
    Transport,
    Unsupported,
    default_channel,
    push_end,
)

__all__ = ["BATCH_BYTES", "MAX_BATCH_ROWS", "MAX_MESSAGE_BYTES", "MemoryTransport", "NullShipper", "Shipper",
           "ShipperStats", "Sink", "default_channel"]

log = logging.getLogger("tracetop.shipper")

MiB = 1 << 20
#: How long a push waits for the rest of a flusher pass's batches (sealed a kind at a time).
PUSH_GATHER_S = 0.005


class Sink(Protocol):
    """Where a producer's rows go: the contract the hooks' Tracer and the agent's relay hold.

    ``record`` and ``record_many`` never block; ``flush`` waits for acks up to its timeout;
    ``stats`` is a plain dict of counters (empty when disabled)."""

    source_id: str
    run_id: str

    def record(self, kind: Kind, *row: Any) -> None: ...
    def record_many(self, kind: Kind, columns: Mapping[str, Any]) -> None: ...
    def forward(self, batch: pb.ColumnBatch) -> bool: ...
    def ship_soon(self) -> None: ...
    def flush(self, timeout_s: float = ...) -> bool: ...
    def close(self, timeout_s: float = ...) -> None: ...
    def stats(self) -> dict[str, Any]: ...


@dataclass
class ShipperStats:
    """The shipper's counters (``stats()`` adds the ledger's loss counts and ``pending_rows``)."""


    recorded: int = 0
    batches_sealed: int = 0
    batches_sent: int = 0
    batches_acked: int = 0
    rows_acked: int = 0
    rows_dropped: int = 0  # these four: from the ledger, in stats()
    batches_dropped: int = 0
    batches_rejected: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    gap_rows: int = 0
    spool_full: int = 0
    spool_write_errors: int = 0  # spool writes the disk refused (ENOSPC, EFBIG): kept in memory or refused
    reconnects: int = 0
    unacked_batches: int = 0
    unacked_bytes: int = 0
    spool_bytes: int = 0
    connected: bool = False
    last_error: str = ""


class Shipper:
    """Batches, numbers, ships, spools and resends events of one source.

    Args:
        endpoint: a collector or agent address (``host:port`` or ``unix:///path``).
        run_id: the run every event belongs to.
        source_id: this producer's id (default: a fresh uuid-based id).
        rank: put into this source's GAP rows (-1 for node-level producers).
        flush_rows / flush_interval_s: seal a kind's buffer at this many rows or this age.
        max_pending_rows: per-kind buffer bound; beyond it the oldest rows are dropped and counted.
        max_unacked_bytes: memory bound on sealed-but-unacked batches.
        spool_dir / spool_max_bytes: durable spool (agent); replayed at start.
        transport: None for gRPC to ``endpoint``; or a ``Transport`` (``stream(batches) -> acks``,
            see tracetop/wire/transport.py: MemoryTransport); or a ``SendTarget`` (``send(batch)``).
        channel_credentials / call_metadata: for the gRPC link (TLS credentials, e.g.
            ``grpc.ssl_channel_credentials(...)``; ``(key, value)`` pairs sent with every stream,
            e.g. ``(("authorization", "Bearer <token>"),)``). Both default to none.
        channel_options: extra gRPC channel options (``ClientAuth.channel_options()``, which
            carries ``--tls-server-name`` / TRACETOP_TLS_SERVER_NAME).
        channel_factory: builds the gRPC channel (tests may inject options).
        clock_ns: wall clock in ns (injectable).
        burst_linger_s: a stream stays open this long after its last batch for more, then
            half-closes; the next batch opens a new one. None: one stream held open throughout.
    """

    def __init__(
        self,
        endpoint: str | None,
        *,
        run_id: str,
        source_id: str | None = None,
        rank: int = -1,
        flush_rows: int = 4096,
        flush_interval_s: float = env.SHIPPER_FLUSH_S,
        max_pending_rows: int = 1 << 20,
        max_unacked_bytes: int = 256 * MiB,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = 1 << 30,
        spool_fsync: bool = True,
        transport: Transport | SendTarget | None = None,
        channel_credentials: Any = None,
        call_metadata: Sequence[tuple[str, str]] | None = None,
        channel_options: Sequence[tuple[str, Any]] | None = None,
        channel_factory: Callable[..., Any] = default_channel,
        clock_ns: Callable[[], int] = time.time_ns,
        reconnect_max_s: float = 1.0,
        burst_linger_s: float | None = 0.1,
    ) -> None:
        if transport is None and not endpoint:
            raise ValueError("Shipper: no endpoint; pass one or set TRACETOP_ENDPOINT (e.g. 127.0.0.1:7000)")
        self.endpoint = endpoint
        self.run_id = run_id
        self.source_id = source_id or f"src-{uuid.uuid4().hex[:16]}"
        #: this start of the source: on every batch it seals, so receivers keep a high-water mark
        #: per start (a restart with the same source_id numbers from 1 again, and is not taken for
        #: a resend), and a sender that does not know it cannot move this start's mark
        self.epoch = secrets.randbits(62) + 1
        self.rank = rank
        self.max_unacked_bytes = max_unacked_bytes
        self._owned: GrpcTransport | None = None  # the transport this shipper made, and closes
        if transport is None:
            transport = self._owned = GrpcTransport(
                endpoint,  # type: ignore[arg-type]
                channel_credentials=channel_credentials,
                call_metadata=call_metadata,
                channel_options=channel_options,
                channel_factory=channel_factory,
            )
        elif not isinstance(transport, Transport):
            transport = SendTransport(transport)
        self._transport: Transport = transport
        self._clock_ns = clock_ns
        self._reconnect_max_s = reconnect_max_s
        self.burst_linger_s = burst_linger_s
        self._use_push = True  # Ingest.Push where the transport has it, until the receiver lacks it

        self._stop = threading.Event()
        self._wake = threading.Event()  # set when a buffer reaches flush_rows or bulk columns arrive
        self._warned: set[str] = set()
        self._pacing = Pacing(flush_interval_s, self._wake.set, self._warn_once)
        # --- producer side: its lock is held only for an append or a swap ---
        self._intake = Intake(flush_rows, max_pending_rows, clock_ns, self._wake.set)

        # --- every loss, and the outbox (guarded by _cv) ---
        self._ledger = DropLedger()
        self._cv = threading.Condition()
        self._outbox = Outbox(self._ledger, max_unacked_bytes)
        self._seq = 0
        self._stats = ShipperStats()
        self._seal_lock = threading.Lock()
        self._sealer = Sealer(source_id=self.source_id, epoch=self.epoch, run_id=run_id, rank=rank, ledger=self._ledger,
                              next_seq=self._next_seq, enqueue=lambda b: self._enqueue(b, own=True),
                              warn_once=self._warn_once, budget_bytes=max_unacked_bytes // 8, clock_ns=clock_ns)

        self._ack_listeners: list[Callable[[int, int], None]] = []
        self._waiting_listeners: list[Callable[[bool], None]] = []  # PushReply.commands_waiting, where said
        self._ship_now = False  # ship_soon(): the flusher's next pass seals everything
        self._closing = False

        self._spool: Spool | None = None
        self.last_spool_error = ""  # the last spool write the disk refused (the relay's refusal says it)
        #: source -> highest seq found on the spool at start (what a killed predecessor had accepted).
        self.replayed_high_water: dict[str, int] = {}
        if spool_dir is not None:
            self._spool = Spool(Path(spool_dir), spool_max_bytes, spool_fsync)
            for path, batch in self._spool.replay(self._ledger, self.replayed_high_water):
                with self._cv:
                    self._outbox.add(batch, batch.ByteSize(), path, own=False)

        self._flusher = threading.Thread(target=self._run_flusher, name="tracetop-flusher", daemon=True)
        self._sender = threading.Thread(target=self._run_sender, name="tracetop-sender", daemon=True)
        self._flusher.start()
        self._sender.start()

    # ------------------------------------------------------------------ producer API
    def record(self, kind: Kind, *row: Any) -> None:
        """Append one row (columns in tracetop.events.SCHEMAS[kind] order). Never blocks."""
        self._intake.record(kind, row)

    def record_many(self, kind: Kind, columns: Mapping[str, Any]) -> None:
        """Queue whole columns (numpy arrays, or lists of str for string columns) as rows."""
        self._intake.record_many(kind, columns)

    @property
    def flush_rows(self) -> int:
        """A kind's rows are sealed at this many (or at ship_interval_s)."""
        return self._intake.flush_rows

    def forward(self, batch: pb.ColumnBatch) -> bool:
        """Relay a batch sealed elsewhere, keeping its source_id and seq. With a spool, returns
        only once the batch is on disk; returns False (and counts it) when the spool is full."""
        return self._enqueue(batch, own=False)

    def ship_soon(self) -> None:
        """Seal everything recorded so far on the flusher thread now, without waiting for acks
        (the hooks call it with each heartbeat: liveness arrives at once, in the same shipment)."""
        self._ship_now = True
        self._wake.set()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Seal everything recorded so far and wait until it is acked. True if it was."""
        self._seal(force=True)
        deadline = time.monotonic() + timeout_s
        with self._cv:
            target = self._outbox.enqueued
            while self._outbox.unacked_through(target):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush for up to timeout_s, then stop. Unacked batches without a spool are reported lost."""
        if self._closing:
            return
        deadline = time.monotonic() + timeout_s
        ok = self.flush(timeout_s)
        self._closing = True
        self._stop.set()
        self._wake.set()
        with self._cv:
            self._outbox.interrupt()
            self._cv.notify_all()
        # bounded by the caller's timeout too (the hooks' exit path: trainer_hooks/shutdown.py)
        self._flusher.join(timeout=min(2.0, max(0.05, deadline - time.monotonic())))
        self._sender.join(timeout=min(2.0, max(0.05, deadline - time.monotonic())))
        if not ok and self._spool is None:
            with self._cv:
                rows = self._outbox.rows()
            if rows:
                log.warning(
                    "tracetop: %d events of source %s were not acked by %s before close; they are lost",
                    rows, self.source_id, self.endpoint,
                )

    def stats(self) -> dict[str, Any]:
        """The counters of ``ShipperStats``, the ledger's loss counts, and ``pending_rows``."""
        with self._cv:
            s = self._stats
            s.batches_sealed = self._sealer.batches_sealed
            s.gap_rows = self._sealer.gap_rows
            s.unacked_batches = len(self._outbox)
            s.unacked_bytes = self._outbox.unacked_bytes
            s.spool_bytes = self._spool.bytes if self._spool else 0
            d = dict(s.__dict__)
        d.update(self._ledger.counters())  # every loss from the one ledger
        d["pending_rows"] = self._intake.pending_rows()
        return d

    # ------------------------------------------------------------------ sealing
    def _has_pending(self) -> bool:
        return bool(self._ledger) or self._intake.has_rows()

    def _next_seq(self) -> int:
        with self._cv:
            self._seq += 1
            return self._seq

    def _run_flusher(self) -> None:
        tick = max(0.01, self.ship_interval_s / 4)
        while True:
            self._wake.wait(tick)
            self._wake.clear()
            if self._stop.is_set():
                return
            # Idle: wake once per interval (a first record then waits at most that long).
            interval = self.ship_interval_s
            tick = max(0.01, interval / 4) if self._has_pending() else interval
            force, self._ship_now = self._ship_now, False
            try:
                self._seal(force=force)
            except Exception as e:  # never let the flusher die: count, log once, go on
                self._warn_once("flusher", f"tracetop: shipper flusher error (continuing): {e!r}")

    def _seal(self, force: bool) -> None:
        with self._seal_lock:
            self._sealer.seal(self._intake.take(self._clock_ns(), self.ship_interval_s, force))

    # ------------------------------------------------------------------ outbox
    def _enqueue(self, batch: pb.ColumnBatch, own: bool) -> bool:
        nbytes = batch.ByteSize()
        spool_path = None
        key = (source_key(batch.source_id, batch.epoch), batch.seq)
        with self._cv:
            if key in self._outbox:
                return True  # already held (and spooled): a resend, not new data
        if self._spool is not None:
            try:
                spool_path = self._spool.write(batch, nbytes)
                failed = None
            except SpoolWriteError as e:  # disk full, a size limit: nothing of it is on the spool
                spool_path, failed = None, e
            if spool_path is None:
                with self._cv:
                    if failed is None:
                        self._stats.spool_full += 1
                    else:
                        self._stats.spool_write_errors += 1
                        self.last_spool_error = str(failed)
                if not own:
                    return False  # the caller keeps it (the relay: the hook resends it later)
                if failed is None:
                    self._warn_once("spool-full", f"tracetop: spool {self._spool.root} is full; keeping batches in memory only")
                else:  # kept in memory: lost only if the unacked budget drops it, and then counted
                    self._warn_once("spool-write", f"tracetop: {failed}; keeping batches in memory only until the disk takes them")
        with self._cv:
            if self._outbox.add(batch, nbytes, spool_path, own) is not None:
                self._cv.notify_all()
        return True

    def on_acked(self, fn: Callable[[int, int], None]) -> None:
        """Call ``fn(kind, rows)`` (from the sender thread; it must not block) for each of this
        source's own batches acked: the hooks count their acked STEP rows (trainer_hooks/progress.py)."""
        self._ack_listeners.append(fn)

    def _on_ack(self, source_id: str, seq: int, epoch: int = 0) -> None:
        with self._cv:
            done = self._outbox.ack(self._outbox.key_for(source_id, epoch), seq)
            self._stats.batches_acked += len(done)
            self._stats.rows_acked += sum(e.n for e in done)
            self._cv.notify_all()
        for fn in self._ack_listeners:
            for e in done:
                if e.own:
                    try:
                        fn(e.kind, e.n)
                    except Exception as ex:  # a listener never stops the sender
                        self._warn_once("ack-listener", f"tracetop: ack listener failed: {ex!r}")
        if self._spool is not None:
            for e in done:
                if e.spool_path is not None:
                    self._spool.remove(e.spool_path, e.nbytes)

    # ------------------------------------------------------------------ sending
    def _next_to_send(self, epoch: int, linger_s: float | None = None) -> pb.ColumnBatch | None:
        """Blocks until a batch is due on this connection; None when the connection is over, or
        when nothing came for ``linger_s`` (the end of a burst)."""
        deadline = None if linger_s is None else time.monotonic() + linger_s
        outbox = self._outbox
        with self._cv:
            while True:
                if outbox.epoch != epoch:
                    return None
                e = outbox.next_due(epoch)
                while e is not None:
                    batch = e.batch
                    if batch is None and e.spool_path is not None and self._spool is not None:
                        batch = self._spool.read(e.spool_path)
                        if batch is None:  # the spooled copy cannot be read back: lost, once
                            self._warn_once("spool-read", f"tracetop: unreadable spool file {e.spool_path} set aside")
                            outbox.drop(e, "spool_unreadable")
                            self._spool.set_aside(e.spool_path, e.nbytes)
                    if batch is not None:
                        self._stats.batches_sent += 1
                        return batch
                    e = outbox.next_due(epoch)
                if self._closing:
                    return None
                if deadline is None:
                    self._cv.wait(1.0)  # enqueue, epoch changes and close all notify
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)

    def _requests(self, epoch: int) -> Iterator[pb.ColumnBatch]:
        while True:
            batch = self._next_to_send(epoch, self.burst_linger_s)
            if batch is None:
                return
            yield batch

    def _pushes(self, epoch: int, push: Callable[[Sequence[pb.ColumnBatch]], Any]) -> Iterator[Any]:
        """A burst over ``Ingest.Push``: what is due goes out in calls of up to BATCH_BYTES (one
        larger batch alone), each call's acks yielded once it returns; the burst ends when nothing
        comes within burst_linger_s, as a stream's does. Each reply's ship_interval_s is taken."""
        batch = self._next_to_send(epoch, self.burst_linger_s)
        while batch is not None:
            calls, size, carry = [batch], batch.ByteSize(), None
            while size < BATCH_BYTES:
                # the flusher enqueues one pass's batches a kind at a time: gather them into one call
                nxt = self._next_to_send(epoch, PUSH_GATHER_S)
                if nxt is None:
                    break
                if size + nxt.ByteSize() > BATCH_BYTES:
                    carry = nxt
                    break
                calls.append(nxt)
                size += nxt.ByteSize()
            reply = push(calls)
            self._pacing.ask(float(getattr(reply, "ship_interval_s", 0.0) or 0.0))
            if self._waiting_listeners:
                self._tell_waiting(reply)
            yield from reply.acks
            end = push_end(reply)
            if end is not None:  # taken up to here, then refused or cut short: as a stream that ends so
                raise end
            if carry is None and not self._small_backlog():
                return  # a backlog built up meanwhile: the next burst streams it
            batch = carry if carry is not None else self._next_to_send(epoch, self.burst_linger_s)

    def on_commands_waiting(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(waiting)`` (from the sender thread; it must not block) with each Push reply's
        ``commands_waiting``, where the receiver says it (rank 0's command poller: control_link.py)."""
        self._waiting_listeners.append(fn)

    def _tell_waiting(self, reply: Any) -> None:
        try:
            if not reply.HasField("commands_waiting"):
                return  # a receiver that does not say (an older collector, an agent)
            waiting = bool(reply.commands_waiting)
        except (AttributeError, ValueError):
            return
        for fn in self._waiting_listeners:
            try:
                fn(waiting)
            except Exception as ex:  # a listener never stops the sender
                self._warn_once("waiting-listener", f"tracetop: commands-waiting listener failed: {ex!r}")

    def _small_backlog(self) -> bool:
        """Whether what waits to be acked fits one push (BATCH_BYTES)."""
        with self._cv:
            return self._outbox.unacked_bytes <= BATCH_BYTES

    @property
    def flush_interval_s(self) -> float:
        """This shipper's own interval between shipments (see ``ship_interval_s``)."""
        return self._pacing.flush_interval_s

    @property
    def ship_interval_s(self) -> float:
        """Seconds between shipments now: flush_interval_s, or the shorter interval the receiver
        asks for while someone watches the run (Ingest.Push replies; tracetop/wire/pacing.py)."""
        return self._pacing.interval_s

    @property
    def asked_interval_s(self) -> float:
        """The receiver's latest freshness request (0: none); a relay passes it on to its hooks."""
        return self._pacing.asked_s

    def on_interval_change(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (from the sender thread; it must not block) whenever ship_interval_s
        changes: a producer that buffers rows itself (the hooks' emitter) wakes to follow it."""
        self._pacing.listen(fn)

    def _wait_for_work(self) -> bool:
        """Sender between bursts: True once a batch waits (between bursts every unacked batch is
        one to send), False when stopping."""
        with self._cv:
            while not len(self._outbox) and not self._closing and not self._stop.is_set():
                self._cv.wait(5.0)
            return bool(len(self._outbox)) and not self._stop.is_set()

    def _run_sender(self) -> None:
        """The one sender loop, whatever the transport.

        One stream per burst: it carries what is due plus whatever comes within burst_linger_s,
        half-closes, and ends once the receiver has acked everything. An open but idle gRPC
        stream costs the process ~1.5 ms of CPU a second in grpcio's polling threads
        (docs/benchmarks.md, "The hooks' cost"); between bursts there is none."""
        backoff = 0.05
        try:
            opener = getattr(self._transport, "open", None)
            if opener is not None:
                try:
                    opener()  # the channel now, not at the first burst (it costs ~10 ms of CPU)
                except Exception as e:  # a bad endpoint: each stream retries it, counted there
                    self._warn_once("transport-open", f"tracetop: cannot open a channel to {self.endpoint}: {e!r}")
            while not self._stop.is_set():
                if not self._wait_for_work():
                    break
                with self._cv:
                    epoch = self._outbox.new_epoch()
                clean = False
                acks = None
                try:
                    # a push waits for its commit before the next can go: fine for a burst, not for a
                    # backlog, which a stream pipelines (its acks come while it sends)
                    push = getattr(self._transport, "push", None) if self._use_push and self._small_backlog() else None
                    acks = self._pushes(epoch, push) if push is not None else self._transport.stream(self._requests(epoch))
                    for ack in acks:
                        if not self._stats.connected:
                            self._stats.connected = True
                            backoff = 0.05
                        self._on_ack(ack.source_id, ack.seq, ack.epoch)
                    clean = True  # the receiver acked what it took and ended the stream (or we closed ours)
                except Rejected as e:
                    self._stats.last_error = str(e)
                    self._on_rejected(e)
                    backoff = 0.05
                except Unsupported as e:  # an older receiver: stream from now on (what it had, resent)
                    log.info("tracetop: %s; streaming instead", e)
                    self._use_push = False
                except Exception as e:  # Disconnected, or a transport's own failure: resend on the next
                    self._stats.connected = False
                    self._stats.last_error = str(e)
                    if not isinstance(e, Disconnected):
                        self._warn_once("transport-error", f"tracetop: transport failed (retrying): {e!r}")
                    if self._stats.reconnects == 0:
                        self._warn_once("connect", f"tracetop: cannot reach {self.endpoint or 'the receiver'} ({e}); buffering and retrying")
                    self._stats.reconnects += 1
                finally:
                    if acks is not None and hasattr(acks, "close"):
                        acks.close()
                    with self._cv:
                        self._outbox.end_stream(epoch)
                        self._cv.notify_all()
                if self._stop.is_set():
                    break
                if clean:
                    with self._cv:
                        unacked_sent = self._outbox.sent_unacked(epoch)
                    if not unacked_sent:
                        continue  # a burst like any other; the next opens when a batch is due
                self._stop.wait(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, self._reconnect_max_s)
        finally:
            if self._owned is not None:
                self._owned.close()

    def _on_rejected(self, err: Rejected) -> None:
        """The receiver refused a batch: drop it for good (a gap row says so), resend the rest."""
        self._warn_once(f"rejected-{err.fault[:40]}", f"tracetop: {self.endpoint or 'the receiver'} refused a batch: {err}")
        with self._cv:
            e = self._outbox.reject(err.fault, None if err.source_id is None else self._outbox.key_for(err.source_id, err.epoch),
                                    err.seq)
        if e is not None and e.spool_path is not None and self._spool is not None:
            self._spool.remove(e.spool_path, e.nbytes)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


class NullShipper:
    """The disabled shipper (TRACETOP_DISABLE=1): same API, does nothing."""

    source_id = "disabled"
    run_id = "disabled"

    def record(self, kind: Kind, *row: Any) -> None:
        pass

    def record_many(self, kind: Kind, columns: Mapping[str, Any]) -> None:
        pass

    def forward(self, batch: pb.ColumnBatch) -> bool:
        return True

    def ship_soon(self) -> None:
        pass

    def flush(self, timeout_s: float = 0.0) -> bool:
        return True

    def close(self, timeout_s: float = 0.0) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}
