"""The collector's gRPC edge: Ingest (Stream, Clock), Query (Sql, Watch), Control (not yet).

Runs on grpc.aio: one event-loop thread reads every stream, decodes and validates batches
(tracetop.wire.codec.decode_batch) and converts them to Arrow; the writer thread (writer.py)
commits and hands acks back through the loop. No thread per stream, so many sources cost little.

Faults on a stream end that stream only, with a status naming the fault:
- bytes that do not parse as a ColumnBatch: INVALID_ARGUMENT "not a tracetop.v1.ColumnBatch"
  (a custom deserializer turns parse failures into a marker instead of gRPC's opaque INTERNAL);
- a batch failing decode_batch: INVALID_ARGUMENT "<fault>: <message>", trailing metadata
  `tracetop-fault`, `tracetop-rejected-source`, `tracetop-rejected-seq`;
- a message over --max-batch-mb: gRPC's own RESOURCE_EXHAUSTED.
Batches before the bad one are committed and acked first; nothing of the bad one is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import grpc

from collector.ingest.metrics import CollectorMetrics
from collector.ingest.writer import (
    Ack,
    Barrier,
    QueuedBatch,
    StreamEnd,
    StreamReplies,
    Writer,
    batch_to_arrow,
)
from collector.query import readonly
from tracetop.errors import ListenError
from tracetop.events import table_name
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import Rejection, parse_batch, receive, seq_ahead

log = logging.getLogger("tracetop.collector")

def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address: parsed as an IP (``127.example.com`` is a name that
    starts with 127., not a loopback address), or the name ``localhost``."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host).is_loopback
    except ValueError:
        return False


def check_listen(listen: str, *, closed: bool = False, token_in_clear: bool = False) -> str:
    """Validate a listen address; returns the gRPC bind string. Loopback or a unix socket, or any
    address when ``closed``: the collector authenticates every caller (a bearer token, or mutual
    TLS; TLS alone encrypts but lets anyone in). ``token_in_clear``: a token without TLS, refused
    off loopback (the token would cross the network in clear text)."""
    if listen.startswith("unix:"):
        path = unix_path(listen)
        if not path:
            raise ListenError(f"listen address {listen!r}: give a socket path, e.g. unix:///tmp/tracetop.sock")
        return listen
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ListenError(f"listen address {listen!r} is not HOST:PORT or unix:///PATH")
    if is_loopback(host):
        return listen
    if not closed:
        raise ListenError(
            f"refusing to listen on {listen}: not loopback, and the collector would let anyone in (TLS alone "
            "encrypts, it does not tell callers apart). Give it TLS (--tls-cert FILE --tls-key FILE) with a bearer "
            "token (--token-file FILE) or with mutual TLS (--tls-client-ca FILE), "
            "or listen on 127.0.0.1:PORT or unix:///PATH"
        )
    if token_in_clear:
        raise ListenError(
            f"refusing to listen on {listen}: not loopback, and the bearer token would cross the network in "
            "clear text; add --tls-cert FILE --tls-key FILE, or listen on 127.0.0.1:PORT or unix:///PATH"
        )
    return listen


def unix_path(listen: str) -> str:
    rest = listen[len("unix:") :]
    if rest.startswith("//"):
        rest = rest[2:]
    return rest


def clear_stale_socket(path: str) -> None:
    """Remove a socket file left by a killed collector; refuse if something still answers on it."""
    if not os.path.exists(path):
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        s.close()
    raise ListenError(f"{path}: another process is listening on this socket")


class _AioReplies(StreamReplies):
    """Delivers writer output into one stream's asyncio queue, from the writer thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Ack | StreamEnd] = asyncio.Queue()

    def deliver(self, item: Ack | StreamEnd) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: the stream is long gone
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


#: A Watch's request for a run keeps that run's shipments fresh this long (its retries while the
#: run is unknown, or a TUI reconnecting, keep it so).
WATCH_GRACE_S = 10.0


def _end_status(end: StreamEnd) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None:
    """The status a stream (or push) ends with: a refused batch, a shutdown, a failed commit."""
    if end.fault:
        # end.metadata: tracetop-fault, then tracetop-rejected-source/-seq when the batch is known
        return grpc.StatusCode.INVALID_ARGUMENT, f"{end.fault}: {end.message}", tuple(end.metadata)
    if end.shutdown:
        return (grpc.StatusCode.UNAVAILABLE,
                "collector is shutting down; everything acked is committed, resend the rest to its successor", ())
    if end.store_failed:
        return (grpc.StatusCode.UNAVAILABLE,
                f"collector could not commit ({end.store_failed}); nothing of the unacked batches is stored, resend", ())
    return None


class CollectorService:
    """Ingest + Query handlers over one Writer and its connection."""

    def __init__(self, con, writer: Writer, metrics: CollectorMetrics, *, max_query_rows: int,
                 query_timeout_s: float = readonly.DEFAULT_TIMEOUT_S, fresh_ship_s: float = 0.0,
                 max_query_bytes: int = readonly.DEFAULT_MAX_BYTES) -> None:
        self.max_query_bytes = max_query_bytes
        self.con = con
        #: the shipment interval Push replies ask for while a run is watched (0: never ask)
        self.fresh_ship_s = fresh_ship_s
        self._watching: dict[int, str] = {}  # Watch stream -> the run it shows now
        self._asked_for: dict[str, float] = {}  # run -> when a Watch last asked for it (monotonic), known or not
        self.query_timeout_s = query_timeout_s
        self.writer = writer
        self.metrics = metrics
        self.max_query_rows = max_query_rows
        self.closing = False
        self.open_streams: set[_AioReplies] = set()
        # Query cursors hang off a root cursor made here, never off the writer's connection from
        # another thread; each query gets its own (DuckDB connections are not shared across threads).
        self._query_root = con.cursor()
        self._query_lock = threading.Lock()
        self._watch_cursors: dict[int, tuple[threading.Lock, object]] = {}  # Query.Watch streams' cursors
        self.live_snapshots = None  # collector.query.watch.LiveSnapshots over the live engine, where there is one
        #: run -> whether commands wait for its rank 0 (ControlService.commands_waiting); None: not said
        self.commands_waiting: Callable[[str], bool] | None = None

    def close(self) -> None:
        for lock, cur in list(self._watch_cursors.values()):
            with lock, contextlib.suppress(Exception):
                cur.close()  # type: ignore[attr-defined]
        with self._query_lock:
            self._query_root.close()

    # ---- Ingest.Stream --------------------------------------------------------------------
    async def stream(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        replies = _AioReplies(asyncio.get_running_loop())
        self.open_streams.add(replies)
        self.metrics.streams.inc()
        self.metrics.streams_open.set(len(self.open_streams))
        reader = asyncio.ensure_future(self._read(request_iterator, replies))
        try:
            while True:
                item = await replies.queue.get()
                if isinstance(item, Ack):
                    await context.write(pb.Ack(source_id=item.source_id, seq=item.seq, epoch=item.epoch))
                    continue
                await self._end(item, context)
                return
        finally:
            self.open_streams.discard(replies)
            self.metrics.streams_open.set(len(self.open_streams))
            reader.cancel()

    async def _end(self, end: StreamEnd, context: grpc.aio.ServicerContext) -> None:
        status = _end_status(end)
        if status is not None:
            code, message, metadata = status
            await context.abort(code, message, trailing_metadata=metadata)

    async def _take(self, raw, replies: _AioReplies) -> bool:
        """Hand one received message to the writer; False when the stream (or push) is over."""
        if self.closing or replies.failed:
            return False  # not taken: unacked, the shipper resends
        batch = receive(raw)
        if not isinstance(batch, Rejection):
            # the committed mark (a dict the writer replaces whole): a batch far ahead of it would
            # silence its source if believed (codec.MAX_SEQ_AHEAD)
            batch = seq_ahead(batch.source_id, batch.epoch, batch.seq, self.writer.hwm.get(batch.key, 0)) or batch
        if isinstance(batch, Rejection):
            self._reject(replies, batch)
            return False
        self.metrics.received.labels(table_name(batch.kind)).inc(batch.n)
        table = batch_to_arrow(batch)
        if self.writer.full():
            await self._held()
        return self.writer.submit(QueuedBatch(replies, batch, table))

    async def _held(self) -> None:
        """Backpressure: the writer's queue is full, so this stream waits (gRPC flow control then
        holds its shipper, which keeps, spools or drops and counts). The collector says it is behind."""
        t0 = time.monotonic()
        self.metrics.hold(+1)
        try:
            while self.writer.full() and not self.closing:
                await asyncio.sleep(0.005)
        finally:
            self.metrics.hold(-1, time.monotonic() - t0)

    async def _read(self, request_iterator, replies: _AioReplies) -> None:
        try:
            async for raw in request_iterator:
                if not await self._take(raw, replies):
                    return
            self.writer.submit(Barrier(replies, StreamEnd()))
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as e:  # the client went away mid-stream; the RPC ends with it
            log.debug("collector: stream reader ended: %s", e)
        except Exception as e:  # a bug: end this stream (nothing of its unacked batches is lost)
            log.exception("collector: stream reader failed")
            if not self.writer.submit(Barrier(replies, StreamEnd(store_failed=f"stream reader failed: {e!r}"))):
                replies.deliver(StreamEnd(shutdown=True))

    def _reject(self, replies: _AioReplies, r: Rejection) -> None:
        self.metrics.rejected.labels(r.fault).inc()
        log.warning("collector: rejected batch: %s: %s", r.fault, r.message)
        end = StreamEnd(fault=r.fault, message=r.message, metadata=r.metadata)
        if not self.writer.submit(Barrier(replies, end)):
            replies.deliver(end)

    # ---- Ingest.Push ----------------------------------------------------------------------
    async def push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> pb.PushReply:
        """Stream's work for one burst in one call: the acks come back together once committed."""
        replies = _AioReplies(asyncio.get_running_loop())
        self.open_streams.add(replies)
        self.metrics.pushes.inc()
        runs: set[str] = set()
        try:
            for raw in request.batches:
                batch = parse_batch(raw)
                runs.add(getattr(batch, "run_id", ""))
                if not await self._take(batch, replies):
                    break
            else:
                self.writer.submit(Barrier(replies, StreamEnd()))
            acks = []
            while True:
                item = await replies.queue.get()
                if isinstance(item, Ack):
                    acks.append(pb.Ack(source_id=item.source_id, seq=item.seq, epoch=item.epoch))
                    continue
                reply = pb.PushReply(acks=acks, ship_interval_s=self.ship_interval_for(runs))
                waiting = self.commands_waiting
                if waiting is not None:  # said on every reply: rank 0 polls Control only when it is true
                    reply.commands_waiting = any(waiting(r) for r in runs)
                status = _end_status(item)
                if status is not None:  # the acks still go back, the error after them (as a stream's)
                    code, message, metadata = status
                    reply.end_code, reply.end_message = code.name, message
                    reply.end_metadata.update(dict(metadata))
                return reply
        finally:
            self.open_streams.discard(replies)

    def ship_interval_for(self, runs: set[str]) -> float:
        """What a Push reply asks of shippers of `runs`: fresh_ship_s while one of them is watched."""
        if self.fresh_ship_s <= 0:
            return 0.0
        watched, recent = self._watching.values(), time.monotonic() - WATCH_GRACE_S
        # a Watch that asked for a run not started yet retries: its run counts for a while
        fresh = any(r in watched or self._asked_for.get(r, -1e18) > recent for r in runs)
        return self.fresh_ship_s if fresh else 0.0

    # ---- Ingest.Clock ---------------------------------------------------------------------
    async def clock(self, request: pb.ClockRequest, context) -> pb.ClockReply:
        recv = time.time_ns()
        return pb.ClockReply(client_send_ns=request.client_send_ns, server_recv_ns=recv, server_send_ns=time.time_ns())

    # ---- Query.Sql ------------------------------------------------------------------------
    def _run_sql(self, sql: str, max_rows: int):
        with self._query_lock:
            cur = self._query_root.cursor()
        try:
            return readonly.run_read_only(cur, sql, max_rows, timeout_s=self.query_timeout_s,
                                          max_bytes=self.max_query_bytes)
        finally:
            cur.close()

    async def sql(self, request: pb.QueryRequest, context: grpc.aio.ServicerContext) -> pb.QueryReply:
        import duckdb

        max_rows = min(request.max_rows or self.max_query_rows, self.max_query_rows)
        try:
            table, truncated = await asyncio.to_thread(self._run_sql, request.sql, max_rows)
        except Exception as e:
            if readonly.is_refusal(e):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            if isinstance(e, readonly.QueryLimit):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            if isinstance(e, duckdb.OutOfMemoryException):
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"query needs more memory than the collector allows (--memory-limit-mb): {str(e).splitlines()[0]}; "
                    "aggregate more, or run it on the file after the run",
                )
            if isinstance(e, duckdb.Error):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
            raise
        return pb.QueryReply(arrow_ipc=readonly.to_ipc(table), truncated=truncated)

    # ---- Query.Watch ----------------------------------------------------------------------
    async def watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext):
        """Snapshots of one run (the newest when run_id is empty) every interval_s, built off the
        event loop on a cursor of this stream's own (collector/query/watch.py)."""
        from collector.query import snapshot as snap
        from collector.query import watch

        interval_s = watch.clamp_interval(request.interval_s)
        with self._query_lock:
            cur = self._query_root.cursor()
        # The cursor is used by one worker thread at a time; a cancelled stream (the client went
        # away mid-query) closes it only once that query is done, never under it.
        lock = threading.Lock()
        self._watch_cursors[id(cur)] = (lock, cur)

        def build(fn, *args, **kw):
            with lock:
                return fn(cur, *args, **kw)

        if request.run_id:
            self._asked_for[request.run_id] = time.monotonic()
            if len(self._asked_for) > 1024:  # a bound: the oldest asks go
                for old in sorted(self._asked_for, key=self._asked_for.__getitem__)[:512]:
                    del self._asked_for[old]
        try:
            run_id = request.run_id
            state = snap.Cursor(run_id)
            while not self.closing:
                t0 = time.monotonic()
                if not run_id:
                    run_id = await asyncio.to_thread(build, watch.newest_run) or ""
                    state = snap.Cursor(run_id)
                if run_id:
                    self._watching[id(cur)] = run_id  # its shippers are asked to ship fresh (Push replies)
                if not run_id:  # nothing started yet: say so, keep the stream
                    data = snap.encode(snap.Snapshot({"run_id": "", "waiting": True, "source": "collector"}))
                else:
                    def encoded(run_id: str = run_id, state: snap.Cursor = state) -> bytes:
                        built = build(watch.build, run_id, cursor=state, live=self.live_snapshots)
                        return snap.encode(self.with_lag(built))

                    try:
                        data = await asyncio.to_thread(encoded)
                    except watch.UnknownRun as e:
                        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
                await context.write(pb.Snapshot(taken_ns=time.time_ns(), arrow_ipc=data))
                await asyncio.sleep(max(interval_s - (time.monotonic() - t0), 0.0))
        finally:
            self._watching.pop(id(cur), None)

            def close() -> None:
                with lock, contextlib.suppress(Exception):
                    cur.close()
                self._watch_cursors.pop(id(cur), None)

            asyncio.get_running_loop().run_in_executor(None, close)

    def with_lag(self, built):
        """The snapshot with the collector's own state in its header while it is behind (the TUI's
        "collector behind" line): `collector_behind` = CollectorLag's fields."""
        lag = self.metrics.lag()
        if not lag.behind_s:
            return built
        return dataclasses.replace(built, header={**built.header, "collector_behind": dataclasses.asdict(lag)})

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        ingest = grpc.method_handlers_generic_handler(
            "tracetop.v1.Ingest",
            {
                "Stream": grpc.stream_stream_rpc_method_handler(
                    self.stream, request_deserializer=parse_batch, response_serializer=pb.Ack.SerializeToString
                ),
                "Push": grpc.unary_unary_rpc_method_handler(
                    self.push, request_deserializer=pb.PushRequest.FromString,
                    response_serializer=pb.PushReply.SerializeToString,
                ),
                "Clock": grpc.unary_unary_rpc_method_handler(
                    self.clock,
                    request_deserializer=pb.ClockRequest.FromString,
                    response_serializer=pb.ClockReply.SerializeToString,
                ),
            },
        )
        query = grpc.method_handlers_generic_handler(
            "tracetop.v1.Query",
            {
                "Sql": grpc.unary_unary_rpc_method_handler(
                    self.sql,
                    request_deserializer=pb.QueryRequest.FromString,
                    response_serializer=pb.QueryReply.SerializeToString,
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self.watch,
                    request_deserializer=pb.WatchRequest.FromString,
                    response_serializer=pb.Snapshot.SerializeToString,
                ),
            },
        )
        return [ingest, query]
