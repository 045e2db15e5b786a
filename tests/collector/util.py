"""Raw-stub clients for the collector tests: batches built with the real codec, streams fed from a
queue with acks collected by a thread, and SQL through the collector's Query service."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
import pyarrow as pa

from tracetop.events import SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.codec import encode_batch


def columns(kind: Kind, n: int, seed: int = 0) -> dict:
    """Deterministic columns for any kind: rank = row % 8, step = seed, strings from a small set."""
    out: dict = {}
    for col in SCHEMAS[kind]:
        if col.dtype == "str":
            out[col.name] = [f"{col.name}{i % 3}" for i in range(n)]
        elif col.name == "rank":
            out[col.name] = np.arange(n) % 8
        elif col.name == "step":
            out[col.name] = np.full(n, seed)
        elif col.dtype == "f8":
            out[col.name] = np.where(np.arange(n) % 2 == 0, np.nan, 1.5)
        else:
            out[col.name] = np.arange(n) + 1
    return out


def batch(source: str, seq: int, n: int = 100, kind: Kind = Kind.STEP, run_id: str = "run-1") -> pb.ColumnBatch:
    return encode_batch(kind, columns(kind, n, seed=seq), source_id=source, seq=seq, run_id=run_id,
                        first_record_ns=time.time_ns())


class Feeder:
    """One Ingest.Stream: `send` batches (or raw bytes with raw=True), `wait_ack`, `close`,
    `wait_end` -> the RpcError that ended it (None for a clean end)."""

    def __init__(self, addr: str, *, raw: bool = False, channel: grpc.Channel | None = None) -> None:
        self.channel = channel or grpc.insecure_channel(
            addr, options=[("grpc.max_send_message_length", 256 * 1024 * 1024)]
        )
        self._own_channel = channel is None
        self.q: queue.Queue = queue.Queue()
        self.acks: dict[str, int] = {}
        self.ack_log: list[tuple[str, int]] = []
        self.error: grpc.RpcError | None = None
        self._cond = threading.Condition()
        self._done = False
        if raw:
            call = self.channel.stream_stream(
                "/tracetop.v1.Ingest/Stream", request_serializer=None, response_deserializer=pb.Ack.FromString
            )
        else:
            call = pb_grpc.IngestStub(self.channel).Stream
        self.call = call(iter(self.q.get, None))
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for ack in self.call:
                with self._cond:
                    self.acks[ack.source_id] = max(self.acks.get(ack.source_id, 0), ack.seq)
                    self.ack_log.append((ack.source_id, ack.seq))
                    self._cond.notify_all()
        except grpc.RpcError as e:
            self.error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def send(self, item) -> None:
        self.q.put(item)

    def close(self) -> None:
        self.q.put(None)

    def wait_ack(self, source: str, seq: int, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.acks.get(source, 0) < seq:
                if self._done:
                    raise AssertionError(f"stream ended before ack {source}/{seq}: {self.error!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no ack for {source}/{seq} within {timeout_s} s (have {self.acks})")
                self._cond.wait(left)
            return self.acks[source]

    def wait_end(self, timeout_s: float = 30.0) -> grpc.RpcError | None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "stream did not end"
        if self._own_channel:
            self.channel.close()
        return self.error


def sql(addr: str, query: str, max_rows: int = 0) -> pa.Table:
    with grpc.insecure_channel(addr) as ch:
        reply = pb_grpc.QueryStub(ch).Sql(pb.QueryRequest(sql=query, max_rows=max_rows), timeout=60)
    return pa.ipc.open_stream(pa.py_buffer(reply.arrow_ipc)).read_all()


def scalar(addr: str, query: str):
    return sql(addr, query).column(0)[0].as_py()


def trailing(err: grpc.RpcError) -> dict[str, str]:
    return {k: v for k, v in (err.trailing_metadata() or ())}
