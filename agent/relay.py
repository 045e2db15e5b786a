"""The local relay: the Ingest endpoint the hooks of this node ship to.

Each hook batch is validated exactly as the collector validates it (`decode_batch`; a fault ends
the stream with INVALID_ARGUMENT "<fault>: <message>" and trailing metadata `tracetop-fault`,
`tracetop-rejected-source`, `tracetop-rejected-seq`; nothing of it is spooled), then handed to the
shared shipper's `forward`, which returns only once the batch is on the disk spool. Only then is
it acked to the hook (Ack{source_id, seq}, cumulative per source). Source ids and seqs are kept,
so the collector's per-source high-water mark removes any duplicate the relay sends twice.

A full spool: the batch is not acked and the stream ends with RESOURCE_EXHAUSTED (the hook keeps
the batch and everything after it, and resends them on reconnect; refusing only one batch and
accepting the next would let the collector's high-water mark pass over it). Each refusal is
counted (`spool_full`, the metric `tracetop_agent_spool_full_events_total`) and logged once per
batch. A refusal is not a loss, so it writes no GAP row: the hook still holds the batch, and if it
must drop it later (its unacked budget, its row buffers) its own ledger records exactly that loss
(`unacked_full`, `queue_full`), once. (A GAP row here counted every refused row as lost, and
counted it twice when the hook then dropped it.)

The relay serves at most ``max_workers - 2`` calls at once; a stream that brings no batch for
``idle_stream_s`` is ended (cancelled: the hook's shipper opens a new one when it has a batch;
its own streams close 0.1 s after a burst), so a local process holding idle streams cannot keep
every slot from the hooks.

A batch resent after it was spooled (seq <= the highest seq spooled for its source) is acked
without spooling it again. A source here is one start of a hook's shipper (``codec.source_key``:
its id and epoch); a seq more than ``codec.MAX_SEQ_AHEAD`` past its source's mark is refused
(INVALID_ARGUMENT, fault ``seq_ahead``), not believed: believing it would turn every later batch
of the source into a "duplicate". A spool write the disk refuses (full, a size limit) is refused
like a full spool (RESOURCE_EXHAUSTED, the hook keeps the batch), and leaves nothing counted.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tracetop import env
from tracetop.errors import ListenError
from tracetop.wire import local
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import Rejection, parse_batch, receive, seq_ahead
from tracetop.wire.shipper import Sink
from tracetop.wire.transport import RECEIVER_OPTIONS

log = logging.getLogger("tracetop.agent.relay")

MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class _End:
    """How a relay stream or push ends before its last batch: the status, after the acks."""

    code: grpc.StatusCode
    message: str
    metadata: tuple[tuple[str, str], ...] = ()


def _prepare_unix_socket(path: str) -> None:
    """Make the socket's folder this user's alone (created 0700; an existing one must be a real
    folder of this user's or root's that nobody else may write: the hooks trust no other, see
    tracetop/wire/local.py), remove a stale socket file (left by a killed agent), and refuse if an
    agent still listens there."""
    folder = Path(os.path.abspath(path)).parent
    try:
        if not folder.exists() or str(folder) == env.default_agent_dir():
            local.ensure_private_dir(folder)
        else:
            local.check_folder(folder)
    except local.LocalPeerError as e:
        raise ListenError(f"{e} (the hooks would not trust a socket there)") from None
    if not os.path.exists(path):
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(path)
    except OSError:
        os.unlink(path)  # nobody answers: stale
        return
    finally:
        s.close()
    raise ListenError(
        f"another process is already listening on {path}; stop it or pass another --listen"
    )


class Relay:
    """gRPC Ingest server (unix socket and/or loopback TCP) in front of a shipper with a spool.

    Args:
        shipper: the agent's shipper (`forward(batch) -> bool`, `record(kind, *row)`).
        listen: addresses (``unix:///path``, ``127.0.0.1:PORT``).
        on_batch: called with every accepted DecodedBatch (the agent learns pid -> rank here).
        high_water: source -> highest seq already spooled (the shipper's `replayed_high_water`).
    """

    def __init__(
        self,
        shipper: Sink,
        listen: list[str],
        *,
        on_batch: Callable[[Any], None] | None = None,
        max_workers: int = 64,
        clock_ns: Callable[[], int] = time.time_ns,
        high_water: dict[str, int] | None = None,
        control_target: str | None = None,
        control_auth: Any = None,
        idle_stream_s: float = 30.0,
        max_sources: int = 65_536,
    ) -> None:
        #: the most sources whose marks (and locks) are kept; past it the least recently heard go.
        #: Forgetting a mark is safe: a resend is then spooled again, and the collector's own mark
        #: (per source start) answers it as a duplicate. The refused-batch log set is bounded alike.
        self.max_sources = max_sources
        #: a stream without a batch this long is cancelled, its slot freed (see the module doc)
        self.idle_stream_s = idle_stream_s
        self._streams: dict[int, list] = {}  # open streams: id -> [context, monotonic of its last batch]
        self._idle_stop = threading.Event()
        self._idle_thread: threading.Thread | None = None
        self.shipper = shipper
        # how the forwarded Control calls prove themselves to the collector (tracetop.wire.auth.ClientAuth)
        self.control_auth = control_auth
        # the collector, for the control relay: rank 0's hooks on this node poll commands and every
        # rank reports through the agent they ship to (Control.Poll / Report, forwarded as they are)
        self.control_target = control_target
        self._control_channel: grpc.Channel | None = None
        self.listen = listen
        self.on_batch = on_batch
        self.clock_ns = clock_ns
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._high: dict[str, int] = dict(high_water or {})  # source key -> highest seq spooled
        self._source_locks: dict[str, threading.Lock] = {}
        self._refused: set[tuple[str, int]] = set()
        self._counts = {
            "relay_batches": 0,
            "relay_rows": 0,
            "relay_duplicates": 0,
            "relay_rejected": 0,
            "spool_full": 0,
        }
        self.server: grpc.Server | None = None
        self.ports: dict[str, int] = {}

    # ---- lifecycle ----
    def start(self) -> Relay:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="tracetop-relay"),
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                *RECEIVER_OPTIONS,  # the hooks' keepalive pings are welcome
            ],
            maximum_concurrent_rpcs=self._max_workers - 2,
        )
        handler = grpc.method_handlers_generic_handler(
            "tracetop.v1.Ingest",
            {
                "Stream": grpc.stream_stream_rpc_method_handler(
                    self._stream,
                    request_deserializer=parse_batch,
                    response_serializer=pb.Ack.SerializeToString,
                ),
                "Push": grpc.unary_unary_rpc_method_handler(
                    self._push,
                    request_deserializer=pb.PushRequest.FromString,
                    response_serializer=pb.PushReply.SerializeToString,
                ),
                "Clock": grpc.unary_unary_rpc_method_handler(
                    self._clock,
                    request_deserializer=pb.ClockRequest.FromString,
                    response_serializer=pb.ClockReply.SerializeToString,
                ),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        if self.control_target:
            control = grpc.method_handlers_generic_handler("tracetop.v1.Control", {
                name: grpc.unary_unary_rpc_method_handler(
                    self._forward(name), request_deserializer=req.FromString, response_serializer=resp.SerializeToString)
                for name, req, resp in (("Poll", pb.SubscribeRequest, pb.CommandBatch),
                                        ("Report", pb.CommandStatus, pb.StatusAck))})
            server.add_generic_rpc_handlers((control,))
        for addr in self.listen:
            path = local.unix_path(addr)
            if path is not None:
                _prepare_unix_socket(path)
            else:
                host = addr.rpartition(":")[0]
                if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
                    raise ListenError(
                        f"relay address {addr!r}: the relay listens on a unix socket or loopback only"
                    )
            try:
                port = server.add_insecure_port(addr)
            except RuntimeError as e:
                raise ListenError(f"cannot listen on {addr}: {e}") from e
            if port == 0 and path is None:
                raise ListenError(f"cannot listen on {addr} (address in use?)")
            self.ports[addr] = port
        server.start()
        self.server = server
        self._idle_thread = threading.Thread(target=self._end_idle_streams, name="tracetop-relay-idle", daemon=True)
        self._idle_thread.start()
        return self

    def _end_idle_streams(self) -> None:
        while not self._idle_stop.wait(min(1.0, self.idle_stream_s / 4)):
            cutoff = time.monotonic() - self.idle_stream_s
            with self._lock:
                idle = [ctx for ctx, last in self._streams.values() if last < cutoff]
            for ctx in idle:
                log.info("agent relay: a stream brought no batch for %.0f s; ending it to free its slot", self.idle_stream_s)
                ctx.cancel()

    def _forward(self, name: str) -> Callable[[Any, Any], Any]:
        """A unary Control call passed to the collector; its status (UNAVAILABLE when the collector
        is away) goes back to the caller, whose poller retries."""
        def call(request: Any, context: Any) -> Any:
            from tracetop.wire import tracetop_pb2_grpc as pb_grpc

            with self._lock:
                if self._control_channel is None:
                    if self.control_auth is not None:
                        self._control_channel = self.control_auth.channel(self.control_target)
                    else:
                        self._control_channel = grpc.insecure_channel(self.control_target)  # type: ignore[arg-type]
            metadata = tuple(self.control_auth.metadata()) if self.control_auth is not None else ()
            try:
                return getattr(pb_grpc.ControlStub(self._control_channel), name)(request, timeout=10, metadata=metadata)
            except grpc.RpcError as e:
                context.abort(e.code(), f"agent relay -> collector {self.control_target}: {e.details()}")

        return call

    def stop(self, grace_s: float = 1.0) -> None:
        self._idle_stop.set()
        if self._control_channel is not None:
            self._control_channel.close()
        if self.server is not None:
            self.server.stop(grace_s).wait(grace_s + 1)
            self.server = None
        for addr in self.listen:
            path = local.unix_path(addr)
            if path and os.path.exists(path):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def addresses(self) -> list[str]:
        """The listen addresses as bound (a TCP port 0 replaced by the port picked)."""
        out = []
        for addr, port in self.ports.items():
            if local.unix_path(addr) is None and addr.endswith(":0"):
                addr = f"{addr[:-2]}:{port}"
            out.append(addr)
        return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _count(self, key: str, by: int = 1) -> None:
        with self._lock:
            self._counts[key] += by

    # ---- Ingest.Clock: hooks may align to their agent ----
    def _clock(self, request: pb.ClockRequest, context: Any) -> pb.ClockReply:
        recv = self.clock_ns()
        return pb.ClockReply(
            client_send_ns=request.client_send_ns, server_recv_ns=recv, server_send_ns=self.clock_ns()
        )

    # ---- Ingest.Stream ----
    def _source_lock(self, source: str) -> threading.Lock:
        with self._lock:
            lk = self._source_locks.get(source)
            if lk is None:
                lk = self._source_locks[source] = threading.Lock()
            return lk

    def _forget_oldest(self) -> None:
        """Under self._lock: drop the least recently heard sources' marks, and their locks when free."""
        for key in list(self._high)[: max(1, len(self._high) - self.max_sources)]:
            del self._high[key]
            lk = self._source_locks.get(key)
            if lk is not None and not lk.locked():
                del self._source_locks[key]
        if len(self._source_locks) > 2 * self.max_sources:  # locks of sources never marked (refused)
            for key in [k for k, lk in self._source_locks.items() if k not in self._high and not lk.locked()]:
                del self._source_locks[key]

    def _stream(self, request_iterator: Iterator[Any], context: Any) -> Iterator[pb.Ack]:
        key = id(context)
        entry = [context, time.monotonic()]
        with self._lock:
            self._streams[key] = entry

        def requests() -> Iterator[Any]:
            for raw in request_iterator:
                entry[1] = time.monotonic()
                yield raw

        try:
            for item in self._take(requests()):
                if isinstance(item, _End):
                    if item.metadata:
                        context.set_trailing_metadata(item.metadata)
                    context.abort(item.code, item.message)
                    return
                entry[1] = time.monotonic()
                yield item
        finally:
            with self._lock:
                self._streams.pop(key, None)

    def _take(self, request_iterator: Iterator[Any]) -> Iterator[pb.Ack | _End]:
        """Acks for the batches taken, in order; an _End last when one is refused."""
        for raw in request_iterator:
            batch = receive(raw)
            if not isinstance(batch, Rejection):
                with self._lock:
                    high = self._high.get(batch.key, 0)
                batch = seq_ahead(batch.source_id, batch.epoch, batch.seq, high) or batch
            if isinstance(batch, Rejection):
                self._count("relay_rejected")
                log.warning("agent relay: rejected batch: %s: %s", batch.fault, batch.message)
                yield _End(grpc.StatusCode.INVALID_ARGUMENT, f"{batch.fault}: {batch.message}", batch.metadata)
                return
            source, seq, epoch, key = batch.source_id, batch.seq, batch.epoch, batch.key
            # One source is one shipper: its batches are forwarded in order, even across a reconnect
            # that briefly overlaps the old stream.
            with self._source_lock(key):
                if seq <= self._high.get(key, 0):
                    self._count("relay_duplicates")
                    yield pb.Ack(source_id=source, seq=self._high[key], epoch=epoch)
                    continue
                if not self.shipper.forward(raw):
                    why = getattr(self.shipper, "last_spool_error", "") or "agent spool is full"
                    self._spool_full(batch)
                    yield _End(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{why}: batch {source}/{seq} not taken; keep it and resend "
                               "(raise --spool-max-mb, free disk, or bring the collector back)")
                    return
                with self._lock:
                    self._high.pop(key, None)
                    self._high[key] = seq  # most recently heard last
                    if len(self._high) > self.max_sources:
                        self._forget_oldest()
            with self._lock:
                self._counts["relay_batches"] += 1
                self._counts["relay_rows"] += batch.n
            if self.on_batch is not None:
                try:
                    self.on_batch(batch)
                except Exception:
                    log.exception("agent relay: on_batch hook failed (continuing)")
            yield pb.Ack(source_id=source, seq=seq, epoch=epoch)

    def _push(self, request: pb.PushRequest, context: Any) -> pb.PushReply:
        """Ingest.Push: a burst in one call, taken exactly as a stream takes it."""
        # the collector's freshness request, as this relay's own shipper last heard it
        reply = pb.PushReply(ship_interval_s=float(getattr(self.shipper, "asked_interval_s", 0.0)))
        for item in self._take(parse_batch(raw) for raw in request.batches):
            if isinstance(item, _End):  # the acks go back, the error after them (as a stream's)
                reply.end_code, reply.end_message = item.code.name, item.message
                reply.end_metadata.update(dict(item.metadata))
                break
            reply.acks.append(item)
        return reply

    def _spool_full(self, batch: Any) -> None:
        """Count a refusal (every one) and log it once per batch; no GAP row (see the module doc)."""
        key = (batch.source_id, batch.seq)
        with self._lock:
            self._counts["spool_full"] += 1
            first = key not in self._refused
            if first:
                if len(self._refused) >= self.max_sources:
                    self._refused.clear()  # only decides what is logged: at worst a line again
                self._refused.add(key)
        if first:
            log.warning(
                "agent relay: spool full, refused batch %s/%s (%d rows); the hook keeps it and resends it",
                batch.source_id, batch.seq, batch.n,
            )
