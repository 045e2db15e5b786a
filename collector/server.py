"""The collector's gRPC edge: Ingest (Stream, Clock), Query (Sql; Watch not yet), Control (not yet).

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
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc

from collector import readonly
from collector.metrics import CollectorMetrics, serve_metrics
from collector.schema import open_store
from collector.writer import Ack, Barrier, Pending, StreamEnd, StreamSink, Writer, batch_to_arrow
from tracetop.events import table_name
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.codec import Rejection, parse_batch, receive

log = logging.getLogger("tracetop.collector")

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


class ListenError(ValueError):
    pass




def check_listen(listen: str, *, insecure_bind: bool = False) -> str:
    """Validate a listen address; returns the gRPC bind string. Loopback or unix only, unless
    insecure_bind (there is no TLS or token auth yet)."""
    if listen.startswith("unix:"):
        path = _unix_path(listen)
        if not path:
            raise ListenError(f"listen address {listen!r}: give a socket path, e.g. unix:///tmp/tracetop.sock")
        return listen
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ListenError(f"listen address {listen!r} is not HOST:PORT or unix:///PATH")
    if host not in LOOPBACK_HOSTS and not host.startswith("127.") and not insecure_bind:
        raise ListenError(
            f"refusing to listen on {listen}: not loopback, and the collector has no TLS or token auth yet "
            "(future work). Use 127.0.0.1:PORT or unix:///PATH, or pass --insecure-bind on a trusted network"
        )
    return listen


def _unix_path(listen: str) -> str:
    rest = listen[len("unix:") :]
    if rest.startswith("//"):
        rest = rest[2:]
    return rest


def _clear_stale_socket(path: str) -> None:
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


class _AioSink(StreamSink):
    """Delivers writer output into one stream's asyncio queue, from the writer thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Ack | StreamEnd] = asyncio.Queue()

    def deliver(self, item: Ack | StreamEnd) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: the stream is long gone
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class CollectorService:
    """Ingest + Query handlers over one Writer and its connection."""

    def __init__(self, con, writer: Writer, metrics: CollectorMetrics, *, max_query_rows: int) -> None:
        self.con = con
        self.writer = writer
        self.metrics = metrics
        self.max_query_rows = max_query_rows
        self.closing = False
        self.sinks: set[_AioSink] = set()
        # Query cursors hang off a root cursor made here, never off the writer's connection from
        # another thread; each query gets its own (DuckDB connections are not shared across threads).
        self._query_root = con.cursor()
        self._query_lock = threading.Lock()

    def close(self) -> None:
        with self._query_lock:
            self._query_root.close()

    # ---- Ingest.Stream --------------------------------------------------------------------
    async def stream(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        sink = _AioSink(asyncio.get_running_loop())
        self.sinks.add(sink)
        self.metrics.streams.inc()
        self.metrics.streams_open.set(len(self.sinks))
        reader = asyncio.ensure_future(self._read(request_iterator, sink))
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, Ack):
                    await context.write(pb.Ack(source_id=item.source_id, seq=item.seq))
                    continue
                await self._end(item, context)
                return
        finally:
            self.sinks.discard(sink)
            self.metrics.streams_open.set(len(self.sinks))
            reader.cancel()

    async def _end(self, end: StreamEnd, context: grpc.aio.ServicerContext) -> None:
        if end.fault:
            # end.metadata: tracetop-fault, then tracetop-rejected-source/-seq when the batch is known
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{end.fault}: {end.message}", trailing_metadata=end.metadata)
        if end.shutdown:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "collector is shutting down; everything acked is committed, resend the rest to its successor",
            )
        if end.store_failed:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"collector could not commit ({end.store_failed}); nothing of the unacked batches is stored, resend",
            )

    async def _read(self, request_iterator, sink: _AioSink) -> None:
        writer = self.writer
        try:
            async for raw in request_iterator:
                if self.closing or sink.failed:
                    return  # not taken: unacked, the shipper resends
                batch = receive(raw)
                if isinstance(batch, Rejection):
                    self._reject(sink, batch)
                    return
                self.metrics.received.labels(table_name(batch.kind)).inc(batch.n)
                table = batch_to_arrow(batch)
                while writer.full() and not self.closing:
                    await asyncio.sleep(0.005)  # backpressure: gRPC flow control holds the shipper
                if not writer.submit(Pending(sink, batch, table)):
                    return
            writer.submit(Barrier(sink, StreamEnd()))
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as e:  # the client went away mid-stream; the RPC ends with it
            log.debug("collector: stream reader ended: %s", e)
        except Exception as e:  # a bug: end this stream (nothing of its unacked batches is lost)
            log.exception("collector: stream reader failed")
            if not self.writer.submit(Barrier(sink, StreamEnd(store_failed=f"stream reader failed: {e!r}"))):
                sink.deliver(StreamEnd(shutdown=True))

    def _reject(self, sink: _AioSink, r: Rejection) -> None:
        self.metrics.rejected.labels(r.fault).inc()
        log.warning("collector: rejected batch: %s: %s", r.fault, r.message)
        end = StreamEnd(fault=r.fault, message=r.message, metadata=r.metadata)
        if not self.writer.submit(Barrier(sink, end)):
            sink.deliver(end)

    # ---- Ingest.Clock ---------------------------------------------------------------------
    async def clock(self, request: pb.ClockRequest, context) -> pb.ClockReply:
        recv = time.time_ns()
        return pb.ClockReply(client_send_ns=request.client_send_ns, server_recv_ns=recv, server_send_ns=time.time_ns())

    # ---- Query.Sql ------------------------------------------------------------------------
    def _run_sql(self, sql: str, max_rows: int):
        with self._query_lock:
            cur = self._query_root.cursor()
        try:
            return readonly.run_read_only(cur, sql, max_rows)
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
            if isinstance(e, duckdb.Error):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
            raise
        return pb.QueryReply(arrow_ipc=readonly.to_ipc(table), truncated=truncated)

    async def watch(self, request, context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Query.Watch arrives with the TUI issue")

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        ingest = grpc.method_handlers_generic_handler(
            "tracetop.v1.Ingest",
            {
                "Stream": grpc.stream_stream_rpc_method_handler(
                    self.stream, request_deserializer=parse_batch, response_serializer=pb.Ack.SerializeToString
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


@dataclass
class Collector:
    """A running collector (inside an event loop). Made by `start`, ended by `shutdown`."""

    server: grpc.aio.Server
    service: CollectorService
    writer: Writer
    con: object
    address: str
    db_path: str
    metrics: CollectorMetrics
    metrics_port: int | None
    metrics_http: object | None
    control: object = None  # collector.control.service.ControlService
    tasks: list = field(default_factory=list)  # the control path's loops (lost-command sweep, controller)

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop taking batches, commit and ack everything taken, end every stream, close the file."""
        self.service.closing = True
        for task in self.tasks:
            task.cancel()
        stopped = asyncio.ensure_future(self.server.stop(grace_s))
        await asyncio.to_thread(self.writer.close)
        for sink in list(self.service.sinks):
            sink.deliver(StreamEnd(shutdown=True))
        await stopped
        if self.metrics_http is not None:
            self.metrics_http.shutdown()  # type: ignore[attr-defined]
        self.service.close()
        if self.control is not None:
            self.control.close()  # type: ignore[attr-defined]
        self.con.close()  # type: ignore[attr-defined]


async def start(
    db_path: str,
    listen: str,
    *,
    max_batch_mb: float = 64,
    metrics_port: int | None = None,
    insecure_bind: bool = False,
    flush_rows: int = 10_000,
    flush_interval_s: float = 0.5,
    max_query_rows: int = readonly.DEFAULT_MAX_ROWS,
    command_ttl_s: float | None = None,
    controller: object = None,
) -> Collector:
    """Open the file, start the writer and the gRPC server. Call inside a running event loop."""
    bind = check_listen(listen, insecure_bind=insecure_bind)
    if bind.startswith("unix:"):
        _clear_stale_socket(_unix_path(bind))
    con = open_store(db_path)
    metrics = CollectorMetrics()
    writer = Writer(
        con,
        flush_rows=flush_rows,
        flush_interval_s=flush_interval_s,
        on_flush=metrics.on_flush,
        on_queue=metrics.on_queue,
    )
    writer.start()
    service = CollectorService(con, writer, metrics, max_query_rows=max_query_rows)
    max_bytes = int(max_batch_mb * 1024 * 1024)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", 512 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
        ]
    )
    server.add_generic_rpc_handlers(service.handlers())
    from collector.control import loop as control_loop

    control, control_servicer = control_loop.make_service(con, command_ttl_s)
    pb_grpc.add_ControlServicer_to_server(control_servicer, server)
    try:
        port = server.add_insecure_port(bind)
    except RuntimeError as e:
        writer.close()
        con.close()
        raise ListenError(f"cannot listen on {listen}: {e}") from e
    if not bind.startswith("unix:"):
        host = bind.rpartition(":")[0]
        address = f"{host}:{port}"
    else:
        address = bind
    await server.start()
    http = None
    if metrics_port is not None:
        http, _ = serve_metrics(metrics_port, metrics.registry)
        metrics_port = http.server_port
    tasks = control_loop.start_tasks(control, con, controller)
    return Collector(server, service, writer, con, address, db_path, metrics, metrics_port, http, control, tasks)


class Handle:
    """A collector running in a background thread (programmatic use: `serve(...)`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, collector: Collector, thread: threading.Thread) -> None:
        self._loop = loop
        self.collector = collector
        self._thread = thread
        self.address = collector.address
        self.db_path = collector.db_path
        self.metrics_port = collector.metrics_port

    def stop(self, grace_s: float = 10.0) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.collector.shutdown(grace_s), self._loop)
        fut.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def serve(db_path: str, listen: str = "127.0.0.1:0", **kwargs) -> Handle:
    """Start a collector in a background thread and return once it listens."""
    loop = asyncio.new_event_loop()
    ready: dict[str, object] = {}
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            ready["c"] = loop.run_until_complete(start(db_path, listen, **kwargs))
        except BaseException as e:  # hand the error to the caller
            ready["e"] = e
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=main, name="tracetop-collector", daemon=True)
    thread.start()
    started.wait()
    if "e" in ready:
        raise ready["e"]  # type: ignore[misc]
    return Handle(loop, ready["c"], thread)  # type: ignore[arg-type]
