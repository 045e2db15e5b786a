"""The shipper's one I/O seam: a transport carries one stream of batches out and yields acks back.

    class Transport(Protocol):
        def stream(self, batches: Iterator[pb.ColumnBatch]) -> Iterator[pb.Ack]: ...

One ``stream()`` call is one connection's worth (one gRPC ``Ingest.Stream``): the transport pulls
batches from ``batches`` (which blocks until one is due and ends at the end of a burst) and
yields cumulative acks (``Ack{source_id, seq}``: every batch of that source up to seq is stored).
It ends in one of three ways:

* returns: the receiver took what it acked and ended the stream (or the shipper ended ``batches``);
* raises :class:`Rejected`: the receiver refused one batch (named, or not: then it is the first
  one sent on this stream that was not acked, since receivers ack everything before the bad one);
  the shipper drops it with a gap row and resends the rest;
* raises :class:`Disconnected`: the stream broke; everything unacked is resent on the next one.

Two transports: :class:`GrpcTransport` (the default; the one place a gRPC channel is opened, with
optional channel credentials and call metadata) and :class:`MemoryTransport`, an in-process
receiver for tests and tools that validates like the collector, and can refuse, disconnect, be
unreachable and ack late, so resends and limbo are tested without a network.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tracetop.errors import TracetopError
from tracetop.events import SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire.codec import DecodedBatch, Rejection, receive, source_key

MiB = 1 << 20
#: gRPC message cap used by the default channel (the collector's default max is 64 MiB).
MAX_MESSAGE_BYTES = 64 * MiB
#: A call's peer that stops answering (a host gone silent: no RST, no FIN) is found by HTTP/2
#: keepalive pings: one after KEEPALIVE_S without a frame, the connection dropped when it is not
#: answered within KEEPALIVE_TIMEOUT_S; the call then fails (UNAVAILABLE) and the shipper resends
#: on a new one. Receivers (the collector, the agent's relay) accept pings this often (RECEIVER_OPTIONS).
KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 10.0
#: Ingest.Push waits for its commit; past this it is given up and resent (a duplicate is acked).
PUSH_TIMEOUT_S = 120.0
#: What receivers of shippers' calls set so the keepalive pings are welcome (by default a gRPC
#: server answers pings more often than every 5 minutes without data with GOAWAY).
RECEIVER_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000 / 2)),
    ("grpc.http2.max_ping_strikes", 0),
)


class TransportError(TracetopError):
    """A stream ended abnormally (see Rejected, Disconnected)."""


class Rejected(TransportError):
    """The receiver refused one batch: ``fault`` names why (``tracetop-fault``); ``source_id`` and
    ``seq`` name the batch when the receiver said which (``tracetop-rejected-source/-seq``)."""

    def __init__(self, fault: str, message: str, source_id: str | None = None, seq: int | None = None,
                 epoch: int = 0) -> None:
        super().__init__(f"{fault}: {message}")
        self.epoch = epoch  # the batch's (tracetop-rejected-epoch; 0 when not said)
        self.fault = fault
        self.message = message
        self.source_id = source_id
        self.seq = seq


class Unsupported(TransportError):
    """The receiver lacks the call asked for (Ingest.Push on an older collector)."""


class Disconnected(TransportError):
    """The stream broke or never opened (receiver unreachable, gone, shutting down, full)."""


@runtime_checkable
class Transport(Protocol):
    """The one seam. A transport may also have ``open()`` (connect ahead of the first burst),
    ``push(batches) -> PushReply`` (one unary call per burst, :class:`GrpcTransport`) and
    ``close()``; the shipper uses each where it is there."""

    def stream(self, batches: Iterator[pb.ColumnBatch]) -> Iterator[Any]:
        """Send ``batches`` on one stream; yield acks (``.source_id``, ``.seq``) as they come."""
        ...


class SendTarget(Protocol):
    """Anything that takes one batch at a time, raising to refuse it (see :class:`SendTransport`)."""

    def send(self, batch: pb.ColumnBatch) -> None: ...


def default_channel(target: str, credentials: Any = None,
                    options: Sequence[tuple[str, Any]] = ()):  # -> grpc.Channel
    """The one place the shipper opens a gRPC channel: insecure, or TLS with ``credentials``
    (``grpc.ssl_channel_credentials(...)``, optionally composed with call credentials).
    ``options`` are added to the shipper's own (e.g. ``ClientAuth.channel_options()``: the
    ``grpc.ssl_target_name_override`` of ``--tls-server-name``)."""
    import grpc

    extra = list(options)
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),  # else 60 s for any ping
        ("grpc.http2.max_pings_without_data", 0),
        *extra,
    ]
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=options)
    return grpc.insecure_channel(target, options=options)


class GrpcTransport:
    """``Ingest.Stream`` to ``endpoint`` (``host:port`` or ``unix:///path``).

    Args:
        channel_credentials: ``grpc.ChannelCredentials`` for TLS (None: an insecure channel).
        call_metadata: ``(key, value)`` pairs sent with every stream, e.g.
            ``(("authorization", "Bearer <token>"),)``.
        channel_options: extra ``(key, value)`` channel options (``ClientAuth.channel_options()``:
            the TLS server name to check); given to the factory as ``options=`` when not empty.
        channel_factory: ``(endpoint)`` or, with credentials, ``(endpoint, credentials)`` ->
            channel; tests may inject options.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        channel_credentials: Any = None,
        call_metadata: Sequence[tuple[str, str]] | None = None,
        channel_options: Sequence[tuple[str, Any]] | None = None,
        channel_factory: Callable[..., Any] = default_channel,
    ) -> None:
        self.endpoint = endpoint
        self.channel_options = tuple(channel_options or ())
        self.channel_credentials = channel_credentials
        self.call_metadata = tuple(call_metadata) if call_metadata else None
        self._channel_factory = channel_factory
        self._channel: Any = None
        self._stub: Any = None
        self._grpc: Any = None

    def open(self) -> Any:
        """Create the channel (idempotent; the shipper's sender calls it at start, as creating a
        channel costs the process ~10 ms of CPU that a first burst mid-training should not pay)."""
        if self._stub is None:
            import grpc

            from tracetop.wire import tracetop_pb2_grpc

            self._grpc = grpc

            kw = {"options": self.channel_options} if self.channel_options else {}
            if self.channel_credentials is None:
                self._channel = self._channel_factory(self.endpoint, **kw)
            else:
                self._channel = self._channel_factory(self.endpoint, self.channel_credentials, **kw)
            self._stub = tracetop_pb2_grpc.IngestStub(self._channel)
        return self._stub

    def stream(self, batches: Iterator[pb.ColumnBatch]) -> Iterator[Any]:
        call = self.open().Stream(batches, metadata=self.call_metadata)
        try:
            yield from call
        except self._grpc.RpcError as e:
            raise self._error(e) from e
        finally:
            call.cancel()

    def push(self, batches: Sequence[pb.ColumnBatch]) -> Any:
        """``Ingest.Push``: the batches in one unary call; the reply (``.acks``, and
        ``.ship_interval_s``, the receiver's freshness request) once they are committed. A receiver
        without Push raises Unsupported (the shipper then streams)."""
        stub = self.open()
        request = pb.PushRequest(batches=[b.SerializeToString() for b in batches])
        try:
            return stub.Push(request, metadata=self.call_metadata, timeout=PUSH_TIMEOUT_S)
        except self._grpc.RpcError as e:
            if e.code() == self._grpc.StatusCode.UNIMPLEMENTED:
                raise Unsupported(f"{self.endpoint} has no Ingest.Push (an older collector)") from e
            raise self._error(e) from e

    def _error(self, e: Any) -> TransportError:
        code = e.code() if hasattr(e, "code") else None
        detail = (e.details() if hasattr(e, "details") else str(e)) or ""
        md = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
        return status_error(code.name if code is not None else "", detail, md, str(code))

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None


def status_error(code: str, detail: str, metadata: dict, shown: str | None = None) -> TransportError:
    """The error a stream or push ended with (its gRPC code's name, details, trailing metadata):
    Rejected for a refused batch (INVALID_ARGUMENT naming it), else Disconnected (resend)."""
    if code == "INVALID_ARGUMENT":
        fault = metadata.get("tracetop-fault") or (detail.split(":", 1)[0][:40] if detail else "invalid")
        source, seq = metadata.get("tracetop-rejected-source"), metadata.get("tracetop-rejected-seq")
        epoch = metadata.get("tracetop-rejected-epoch") or "0"
        return Rejected(fault, detail, source, int(seq) if seq is not None else None,
                        int(epoch) if epoch.isdigit() else 0)
    return Disconnected(f"{shown or 'StatusCode.' + code}: {detail}")


def push_end(reply: Any) -> TransportError | None:
    """What a PushReply's end fields say: None when every batch was taken."""
    code = getattr(reply, "end_code", "")
    return status_error(code, reply.end_message, dict(reply.end_metadata)) if code else None


class SendTransport:
    """Adapts an object with ``send(batch)`` (raising to refuse it) to the stream protocol."""

    def __init__(self, target: SendTarget) -> None:
        self.target = target

    def stream(self, batches: Iterator[pb.ColumnBatch]) -> Iterator[Any]:
        for batch in batches:
            try:
                self.target.send(batch)
            except Exception as e:
                raise Rejected("transport", f"{type(e).__name__}: {e}", batch.source_id, batch.seq, batch.epoch) from e
            yield pb.Ack(source_id=batch.source_id, seq=batch.seq, epoch=batch.epoch)


_END = object()


class _Stream:
    """One stream of a MemoryTransport: what its reader thread hands the shipper, in order."""

    def __init__(self) -> None:
        self.out: collections.deque = collections.deque()
        self.cv = threading.Condition()
        self.held: list[pb.ColumnBatch] = []
        self.over = False

    def put(self, item: Any) -> None:
        with self.cv:
            self.out.append(item)
            self.cv.notify_all()


class MemoryTransport:
    """An in-process receiver: validates each batch as the collector does (``codec.receive``),
    keeps it, drops duplicates (per-source high-water mark) and acks it.

    For tests and for tools that want the rows without a collector. ``rows(kind)`` returns the
    columns of every stored batch of that kind concatenated (strings decoded); ``batches`` holds
    the stored batches, ``received`` the ``(source_id, seq)`` of every batch taken, stored or not.

    Scripted faults, each for the streams to come (thread-safe; call from the test):
      ``refuse(count, fault=, name_batch=)``  the next ``count`` batches are refused (Rejected);
      ``disconnect_after(count)``             the stream breaks after taking ``count`` more batches
                                              (stored and acked); the next one is lost on the wire;
      ``reachable = False``                   new streams fail at once (Disconnected);
      ``hold_acks()`` / ``release_acks()``    ack late: batches are taken but neither stored nor
                                              acked until released (as a collector's commit);
      ``disconnect()``                        the open stream breaks now; held batches are lost.
    """

    def __init__(self) -> None:
        self.batches: list[DecodedBatch] = []
        self.received: list[tuple[str, int]] = []
        self.duplicates = 0
        self.streams = 0
        self.reachable = True
        self._lock = threading.Lock()
        self._high: dict[str, int] = {}
        self._refuse: collections.deque = collections.deque()
        self._break_after: int | None = None
        self._hold = False
        self._current: _Stream | None = None
        self._arrived = threading.Condition(self._lock)

    # ---- scripting ----
    def refuse(self, count: int = 1, *, fault: str = "refused", name_batch: bool = True) -> None:
        with self._lock:
            self._refuse.extend([(fault, name_batch)] * count)

    def disconnect_after(self, count: int) -> None:
        with self._lock:
            self._break_after = count

    def hold_acks(self) -> None:
        with self._lock:
            self._hold = True

    def release_acks(self) -> None:
        """Store and ack every held batch (on the open stream), and stop holding."""
        with self._lock:
            self._hold = False
            st = self._current
        if st is not None:
            self._flush_held(st)

    def disconnect(self) -> None:
        """Break the open stream now: held batches are never stored; holding ends."""
        with self._lock:
            self._hold = False
            st = self._current
        if st is not None:
            with st.cv:
                st.held = []
                st.over = True
                st.out.append(Disconnected("memory transport: disconnected"))
                st.cv.notify_all()

    def wait_received(self, count: int, timeout_s: float = 10.0) -> bool:
        """Wait until at least ``count`` batches were taken in all."""
        with self._arrived:
            return self._arrived.wait_for(lambda: len(self.received) >= count, timeout_s)

    # ---- the transport ----
    def stream(self, batches: Iterator[pb.ColumnBatch]) -> Iterator[Any]:
        with self._lock:
            if not self.reachable:
                raise Disconnected("memory transport: unreachable")
            self.streams += 1
            st = self._current = _Stream()
        reader = threading.Thread(target=self._read, args=(batches, st), name="tracetop-memory-stream", daemon=True)
        reader.start()
        try:
            while True:
                with st.cv:
                    while not st.out:
                        st.cv.wait()
                    item = st.out.popleft()
                if item is _END:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            with st.cv:
                st.over = True
                st.cv.notify_all()
            with self._lock:
                if self._current is st:
                    self._current = None

    def _read(self, batches: Iterator[pb.ColumnBatch], st: _Stream) -> None:
        """The receiving side of one stream (its own thread, as gRPC consumes requests)."""
        try:
            for batch in batches:
                with st.cv:
                    if st.over:
                        return
                got = receive(batch)
                with self._lock:
                    self.received.append((batch.source_id, batch.seq))
                    self._arrived.notify_all()
                    refusal = self._refuse.popleft() if self._refuse else None
                    lost_on_wire = self._break_after == 0
                    if self._break_after is not None:
                        self._break_after = None if self._break_after == 0 else self._break_after - 1
                    held = self._hold and not lost_on_wire and refusal is None and not isinstance(got, Rejection)
                    if held:  # under the lock: release_acks() sees every batch held before it
                        with st.cv:
                            st.held.append(batch)
                if held:
                    continue
                if lost_on_wire:
                    st.put(Disconnected("memory transport: the stream broke (disconnect_after)"))
                    return
                if refusal is not None or isinstance(got, Rejection):
                    if refusal is not None:
                        fault, named = refusal
                        message = "refused by the memory transport"
                    else:
                        assert isinstance(got, Rejection)
                        named = dict(got.metadata).get("tracetop-rejected-seq") is not None
                        fault, message = got.fault, got.message
                    self._flush_held(st)  # a receiver acks everything before the bad batch
                    st.put(Rejected(fault, message, batch.source_id if named else None, batch.seq if named else None,
                                    batch.epoch))
                    return
                self._commit(batch, st, got)
            # the shipper ended the stream: answer what is held once released (or lose it on disconnect)
            with st.cv:
                while st.held and not st.over:
                    st.cv.wait()
            st.put(_END)
        except Exception as e:  # never leave the stream hanging
            st.put(Disconnected(f"memory transport reader failed: {e!r}"))

    def _flush_held(self, st: _Stream) -> None:
        # held stays non-empty until the acks are out, so the reader cannot end the stream first
        with st.cv:
            held = list(st.held)
        for batch in held:
            self._commit(batch, st)
        with st.cv:
            del st.held[: len(held)]
            st.cv.notify_all()

    def _commit(self, batch: pb.ColumnBatch, st: _Stream, decoded: Any = None) -> None:
        if decoded is None:
            decoded = receive(batch)
            if isinstance(decoded, Rejection):
                return
        with self._lock:
            key = source_key(batch.source_id, batch.epoch)
            high = self._high.get(key, 0)
            if batch.seq <= high:
                self.duplicates += 1
            else:
                self._high[key] = high = batch.seq
                self.batches.append(decoded)
        st.put(pb.Ack(source_id=batch.source_id, seq=high, epoch=batch.epoch))

    def send(self, batch: pb.ColumnBatch) -> None:
        """Store one batch outside any stream (validated: raises BatchError; no dedup, no ack)."""
        from tracetop.wire.codec import decode_batch

        decoded = decode_batch(batch)
        with self._lock:
            self.batches.append(decoded)

    # ---- reading what arrived ----
    def rows(self, kind: Kind) -> dict[str, np.ndarray]:
        with self._lock:
            got = [b for b in self.batches if b.kind == kind]
        out: dict[str, np.ndarray] = {}
        for col in SCHEMAS[kind]:
            parts = []
            for b in got:
                v = b.columns[col.name]
                if isinstance(v, tuple):
                    codes, dictionary = v
                    parts.append(np.asarray(dictionary, dtype=object)[codes] if len(dictionary) else np.zeros(0, object))
                else:
                    parts.append(v)
            out[col.name] = np.concatenate(parts) if parts else np.zeros(0)
        return out

    def close(self) -> None:
        pass
