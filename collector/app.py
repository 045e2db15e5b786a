"""The composition root: one `CollectorConfig` in, a running collector out.

`start` opens the file and wires the parts together: the writer thread (ingest/writer.py) with the
collector's own metrics (ingest/metrics.py), the live engine (live/engine.py, when there are
rules), the GAP rows for sources gone silent (ingest/source_ends.py), the gRPC edge
(ingest/server.py), the Control service and the controller (control/loop.py), and the outputs
(export/). `tracetop collector` (cli.py) turns flags and env vars into a `CollectorConfig` and
calls `start`; tests and programs use `serve`, which runs one in a background thread.

What is configuration (plain values, in the config) and what is a collaborator (objects with
threads or state of their own: `exports`, `gauges_fn`, `alerts_fn`, `alert_publishers`,
parameters of `start`) is kept apart, so a config can be built, compared and printed freely.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from collector import compact
from collector.export import Exports, no_alerts, no_gauges
from collector.export.prometheus import AlertsFn, GaugesFn
from collector.ingest.metrics import CollectorMetrics, serve_metrics
from collector.ingest.schema import open_store
from collector.ingest.server import CollectorService, check_listen, clear_stale_socket, unix_path
from collector.ingest.writer import (
    ROLL_NICE,
    ROLL_QUIET_S,
    QueuedBatch,
    StreamEnd,
    StreamReplies,
    Writer,
    batch_to_arrow,
)
from collector.query import readonly
from tracetop.errors import ListenError
from tracetop.wire import tracetop_pb2_grpc as pb_grpc
from tracetop.wire.auth import ServerAuth, server_interceptor
from tracetop.wire.codec import Rejection, receive
from tracetop.wire.transport import RECEIVER_OPTIONS

log = logging.getLogger("tracetop.collector")


@dataclass(frozen=True)
class CollectorConfig:
    """Everything a collector is started with; each field's default is the collector's default.

    `tracetop collector`'s flags map one to one (``--max-batch-mb`` -> ``max_batch_mb``, ...);
    the CLI resolves env vars (TRACETOP_FRESH_SHIP_S, TRACETOP_PRICE_PER_GPU_HOUR) before it
    builds this, so a config holds final values only."""

    #: the DuckDB file to write (created if missing)
    db_path: str
    #: HOST:PORT (port 0 picks one) or unix:///PATH; loopback only unless ``auth`` is closed
    listen: str = "127.0.0.1:0"
    #: the largest message accepted; bigger ones get gRPC's RESOURCE_EXHAUSTED
    max_batch_mb: float = 64
    #: serve Prometheus /metrics on 127.0.0.1:PORT (0 picks one); None: no /metrics
    metrics_port: int | None = None
    #: commit once this many rows wait ...
    flush_rows: int = 10_000
    #: ... or once the oldest waited this long
    flush_interval_s: float = 0.5
    #: the most rows one Query.Sql returns
    max_query_rows: int = readonly.DEFAULT_MAX_ROWS
    #: the most bytes (Arrow) one Query.Sql builds; past it the query is refused
    max_query_bytes: int = readonly.DEFAULT_MAX_BYTES
    #: a Query.Sql is cut off after this long
    query_timeout_s: float = readonly.DEFAULT_TIMEOUT_S
    #: TLS and bearer tokens (tracetop.wire.auth.ServerAuth), checked on every RPC and on /metrics;
    #: None: open, so only loopback and unix-socket addresses are accepted
    auth: ServerAuth | None = None
    #: cap DuckDB's memory for the file (ingest and queries together); None: from memory_cap_mb
    memory_limit_mb: int | None = None
    #: DuckDB's threads for the file (ingest, the roll, queries); None: `default_duckdb_threads()`,
    #: half the cores (1 on 2 cores)
    duckdb_threads: int | None = None
    #: the niceness the views' roll thread adds to its own, so commits come first (writer.ROLL_NICE;
    #: 0: the roll runs as the writer does)
    roll_nice: int = ROLL_NICE
    #: the views' roll waits for the writer to have committed nothing this long (writer.ROLL_QUIET_S;
    #: 0: only for its queue to be short of a commit's worth), ROLL_DEFER_S at most
    roll_quiet_s: float = ROLL_QUIET_S
    #: the collector's memory budget (`memory_budget`): DuckDB's limit (unless memory_limit_mb), the
    #: writer's queue and the live inbox are sized from it; None: sized to the machine
    memory_cap_mb: int | None = None
    #: the live judgments' rules (collector.live.rules.Rule); None: no live engine
    rules: Sequence | None = None
    #: the price of lost GPU time (collector.live.lost.CostSettings); None: the engine's default
    cost: object = None
    #: a run id in this file that the scaling rules compare against
    baseline: str | None = None
    #: steps per run the live engine keeps in memory
    live_window_steps: int = 64
    #: a command rank 0 has not received this long after approval is marked lost; None: 600 s
    command_ttl_s: float | None = None
    #: the closed loop's settings (collector.control.controller.ControllerSettings); None: off
    controller: object = None
    #: a rank source silent this long without its clean close gets a GAP row; None: 30 s, 0: off
    unclosed_after_s: float | None = None
    #: while a Watch stream shows a run, Push replies ask its shippers to ship this often; 0: never
    fresh_ship_s: float = 1.0


#: the default memory cap's ceiling (MB): its live share then holds a run of MAX_WORLD (32,768) ranks
#: over the default 64-step window (~476 MB)
MAX_DEFAULT_CAP_MB = 1536
#: what the collector's memory holds outside the shares of its cap (MB): the interpreter and its
#: libraries (156 MB idle, rules on), the gRPC edge's messages in flight and their Arrow copies
FIXED_MB = 320


def machine_cap_mb() -> int:
    """The default memory cap: 1/8 of the machine's RAM, at most MAX_DEFAULT_CAP_MB, at least 256."""
    import os

    try:
        ram_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (ValueError, OSError):
        return 1024
    return int(max(256, min(MAX_DEFAULT_CAP_MB, ram_mb // 8)))


@dataclass(frozen=True)
class MemoryBudget:
    """How the collector's memory cap is spent: FIXED_MB for what it holds anyway, the rest in shares
    to what grows, each bounded by its share. With the rate: DuckDB's buffer pool, the writer's queue,
    the live inbox (past the queue's share the gRPC edge holds the streams and shippers keep, spool or
    drop and count). With the world's size: the live state of the window's steps (past its share a
    run's further ranks are not judged live, counted in `tracetop_live_rows_refused`). Below ~640 MB
    the shares' floors win over the cap."""

    cap_mb: int
    duckdb_mb: int        # DuckDB's memory_limit (buffer pool, rolls, queries; it spills past it)
    queue_bytes: int      # the writer's queue (Arrow bytes of batches waiting for their commit)
    inbox_rows: int       # the live engine's inbox (committed batches waiting for judgment)
    #: DuckDB's checkpoint_threshold: committed rows live in memory, uncompressed, until the WAL
    #: reaches it. Each checkpoint re-compresses every table's last (partial) row group, so at
    #: DuckDB's 16 MB the writer's 16k-row commits cost 2.0 CPU-s per million STEP rows, at 64 MB
    #: 1.4 (`python -m collector.bench.writer`, docs/benchmarks.md); a quarter of DuckDB's share.
    checkpoint_mb: int = 16
    #: the live state's budget (collector.live.state.LiveState max_bytes): 14 KiB a rank at 64 steps
    live_bytes: int = 256 * 2**20


#: the checkpoint threshold's ceiling (MB): past it the writer's CPU gains nothing measurable
CHECKPOINT_MB = 64


def memory_budget(config: CollectorConfig) -> MemoryBudget:
    """The cap's shares: of what FIXED_MB leaves (at least a quarter of the cap), DuckDB 1/3, the
    writer's queue and the live inbox 1/9 each (~100 B a row in the inbox), the live state 4/9."""
    cap = config.memory_cap_mb or machine_cap_mb()
    rest = max((cap - FIXED_MB) * 2**20, cap * 2**20 // 4)
    duckdb_mb = config.memory_limit_mb or max(128, rest // 3 // 2**20)
    return MemoryBudget(cap, duckdb_mb, rest // 9, max(100_000, rest // 9 // 100),
                        checkpoint_mb=max(16, min(CHECKPOINT_MB, duckdb_mb // 4)),
                        live_bytes=max(16 * 2**20, rest * 4 // 9))


def default_duckdb_threads() -> int:
    """DuckDB's threads when the collector is not told: half the cores it may run on, at least 1.

    The collector's own threads already run DuckDB statements side by side (the writer's commits
    and checkpoints, the views' roll, the live queries; the gRPC edge beside them). A statement
    DuckDB splits over its workers makes its caller wait for them, polling Python's signals, which
    takes the GIL the edge is decoding with: on 2 cores one thread (DuckDB's own default is one
    per core) measured 0.82× the CPU per row, 1.18× the rate and 0.73× the p99 in the rows bench
    (docs/benchmarks.md, "DuckDB's threads"). Larger hosts keep workers for checkpoints and
    queries; there the split is not measured."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def duckdb_settings(budget: MemoryBudget, threads: int | None = None) -> dict[str, str | int]:
    """DuckDB's settings for the collector's file, beyond its memory limit.

    ``threads`` (`--duckdb-threads`; default `default_duckdb_threads()`, half the cores): at 1 the
    writer, the roll and each query run their own statements and DuckDB's workers split none of them.
    TRACETOP_CHECKPOINT_MB overrides the checkpoint threshold (for A/B runs: `bench ingest --ab`).
    TRACETOP_DUCKDB_SET="name=value;name=value" sets any others (for A/B runs).
    DuckDB's vacuum is off (``max_vacuum_tasks = 0``; TRACETOP_MAX_VACUUM_TASKS sets another, DuckDB's
    own default is 100): a vacuum merges the partial row groups each commit leaves and rewrites those
    with deleted rows, and its cost grows with the file (on a 1.1 GB 16k-rank file 0.52–0.98 CPU-s a
    checkpoint against 0.17–0.26 without it: `python -m collector.bench.checkpoint_cost`). At
    16,384 ranks × 300 s, three interleaved pairs: p99 record → commit 1.65–2.35 s → 0.85–1.20 s,
    CPU 80–85% → 66–80%, the file within its spread (1,103–1,186 MB against 1,113–1,143;
    docs/benchmarks.md, "DuckDB's vacuum"). What it leaves: row groups with deleted rows keep them
    (the views' re-rolled steps; a table emptied whole is dropped all the same) and appended row
    groups stay as committed; files up to TRACETOP_COMPACT_MAX_MB are rewritten at close anyway
    (collector/compact.py). A vacuum at close would not help: it frees blocks inside the file, which
    then grows (measured: 49 → 79 MB)."""
    import os

    mb = int(os.environ.get("TRACETOP_CHECKPOINT_MB") or budget.checkpoint_mb)
    out: dict[str, str | int] = {"checkpoint_threshold": f"{mb}MB", "threads": threads or default_duckdb_threads()}
    out["max_vacuum_tasks"] = int(os.environ.get("TRACETOP_MAX_VACUUM_TASKS") or 0)
    for item in filter(None, os.environ.get("TRACETOP_DUCKDB_SET", "").split(";")):
        name, _, value = item.partition("=")
        out[name.strip()] = value.strip()
    return out


#: The collector process's GIL switch interval (Python's default is 5 ms). DuckDB's Python client
#: takes the GIL back between the tasks of a query to check for Ctrl-C, and a thread that asks for it
#: waits until the holder (the gRPC edge decoding, the live engine) lets go, up to the interval: the
#: writer's INSERTs waited there (py-spy, native stacks: ~14% of its samples at 8 sources). At 0.5 ms,
#: two interleaved 5 + 5 runs of `tracetop bench ingest --sources 8`: +7% and +4% ev/s, p99 -13% and
#: -7%, CPU per row -10% and -7% (docs/benchmarks.md, "What holds the ingest rate").
SWITCH_INTERVAL_S = 0.0005


def _env_setting(name: str, parse, ok, default, what: str):
    """An A/B override from the environment: `name` parsed by `parse` and checked by `ok`, or
    `default` when unset. ValueError names a bad value, what it should be, and the fix."""
    import os

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"{name}={raw!r} is not {what}; unset it for the default {default}")
    return value


def switch_interval_s() -> float:
    """The switch interval the collector process runs with: TRACETOP_SWITCH_INTERVAL_S (seconds, for
    A/B runs) or SWITCH_INTERVAL_S. ValueError names a bad value and the fix."""
    return _env_setting("TRACETOP_SWITCH_INTERVAL_S", float, lambda v: 0.0 < v <= 1.0, SWITCH_INTERVAL_S,
                        "a number of seconds in (0, 1]")


def roll_nice() -> int:
    """The niceness of the collector's roll thread: TRACETOP_ROLL_NICE (0-19, for A/B runs; 0 turns it
    off) or ROLL_NICE. ValueError names a bad value and the fix."""
    return _env_setting("TRACETOP_ROLL_NICE", int, lambda v: 0 <= v <= 19, ROLL_NICE, "a niceness from 0 to 19")


def roll_quiet_s() -> float:
    """How long the writer must have committed nothing before the views roll: TRACETOP_ROLL_QUIET_S
    (seconds, for A/B runs; 0: the old wait) or ROLL_QUIET_S. ValueError names a bad value and the fix."""
    return _env_setting("TRACETOP_ROLL_QUIET_S", float, lambda v: 0.0 <= v <= 5.0, ROLL_QUIET_S,
                        "a number of seconds in [0, 5]")


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
    exports: Exports | None = None
    live: object | None = None  # collector.live.engine.LiveEngine when started with rules
    control: object = None  # collector.control.service.ControlService
    tasks: list = field(default_factory=list)  # the control path's loops (lost-command sweep, controller)
    ends: object | None = None  # collector.ingest.source_ends.SourceEnds: sources gone without a clean close

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop taking batches, commit and ack everything taken, end every stream, close the file."""
        self.service.closing = True
        for task in self.tasks:
            task.cancel()
        if self.ends is not None:
            await asyncio.to_thread(self.ends.stop)  # type: ignore[attr-defined]
        stopped = asyncio.ensure_future(self.server.stop(grace_s))
        await asyncio.to_thread(self.writer.close)
        if self.ends is not None:
            await asyncio.to_thread(self.ends.close)  # the watch, as the last commits left it, into the file
        if self.live is not None:
            await asyncio.to_thread(self.live.close)  # type: ignore[attr-defined]
        for replies in list(self.service.open_streams):
            replies.deliver(StreamEnd(shutdown=True))
        await stopped
        if self.metrics_http is not None:
            self.metrics_http.shutdown()  # type: ignore[attr-defined]
        self.service.close()
        if self.control is not None:
            self.control.close()  # type: ignore[attr-defined]
        await self._close_file(grace_s)
        await asyncio.to_thread(compact.at_close, self.db_path)  # small files small (collector/compact.py)
        if self.exports is not None:
            await asyncio.to_thread(self.exports.close)  # bounded: dead receivers are left behind

    async def _close_file(self, grace_s: float) -> None:
        """Close the file's connection. A Query.Sql still running on it (its thread outlives the
        gRPC server's stop, up to the query timeout) makes DuckDB refuse the close ("connection is
        busy"; DuckDB 2 refuses instead of waiting): interrupt it and try again, for at most
        ``grace_s``. Everything the writer took is committed before this point either way."""
        import duckdb

        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while True:
            try:
                self.con.close()  # type: ignore[attr-defined]
                return
            except duckdb.ConnectionException:
                return  # closed already: a refused close can still have closed it (DuckDB 2.0)
            except duckdb.Error as e:
                if loop.time() > deadline:
                    log.warning("collector: the file's connection is still busy after %.0f s (%s); exiting "
                                "without closing it (everything acked is committed)", grace_s, e)
                    return
            try:
                self.con.interrupt()  # type: ignore[attr-defined]
            except duckdb.ConnectionException:
                return
            await asyncio.sleep(0.05)


async def start(
    config: CollectorConfig,
    *,
    exports: Exports | None = None,
    gauges_fn: GaugesFn | None = None,
    alerts_fn: AlertsFn | None = None,
    alert_sinks: Sequence = (),
) -> Collector:
    """Open the file, start the writer and the gRPC server. Call inside a running event loop.

    alert_sinks: where alerts go besides the `alerts` table (collector.live.model.AlertSink; the
    exports' sinks are added).

    exports (collector.export.build): its metrics go on /metrics and its OTLP export starts, fed by
    gauges_fn / alerts_fn (default: the live engine's gauges() / alerts()). Closed at shutdown, bounded."""
    db_path, listen = config.db_path, config.listen
    auth = config.auth or ServerAuth()
    bind = check_listen(listen, closed=auth.authenticates_clients,
                        token_in_clear=auth.token_required and auth.tls_cert is None)
    if bind.startswith("unix:"):
        clear_stale_socket(unix_path(bind))
    budget = memory_budget(config)
    con = open_store(db_path, memory_limit_mb=budget.duckdb_mb, settings=duckdb_settings(budget, config.duckdb_threads))
    metrics = CollectorMetrics()
    exports = exports if exports is not None else Exports()
    live = None
    if config.rules is not None:
        from collector.live.engine import LiveEngine

        live = LiveEngine(config.rules, con=con.cursor(), sinks=[*alert_sinks, exports], baseline=config.baseline,
                          window=config.live_window_steps, cost=config.cost,  # type: ignore[arg-type]
                          max_inbox_rows=budget.inbox_rows, collector_lag=metrics.lag,
                          max_state_bytes=budget.live_bytes)
        # silence and hang checks compare heartbeat times with the collector's clock: put them on it
        # (a rank's clock 40 s off, or stepped back, raised false silent alerts: live/state.py)
        live.ev.state.receive_clock = True
        live.start()
        metrics.attach_live(live)
        gauges_fn = gauges_fn or live.gauges
        alerts_fn = alerts_fn or live.alerts
    exports.attach_metrics(metrics.registry, gauges_fn or no_gauges, alerts_fn or no_alerts)
    writer = Writer(
        con,
        flush_rows=config.flush_rows,
        flush_interval_s=config.flush_interval_s,
        max_queued_bytes=budget.queue_bytes,
        on_flush=metrics.on_flush,
        on_queue=metrics.on_queue,
        on_commit=live.on_commit if live is not None else None,
        roll_nice=config.roll_nice,
        roll_quiet_s=config.roll_quiet_s,
    )
    metrics.attach(writer)
    writer.start()
    ends = watch_source_ends(writer, config.unclosed_after_s, con)
    service = CollectorService(con, writer, metrics, max_query_rows=config.max_query_rows,
                               max_query_bytes=config.max_query_bytes,
                               query_timeout_s=config.query_timeout_s, fresh_ship_s=config.fresh_ship_s)
    if live is not None:
        from collector.query.watch import LiveSnapshots

        service.live_snapshots = LiveSnapshots(live)  # Watch builds the per-rank sections from the engine's state
    max_bytes = int(config.max_batch_mb * 1024 * 1024)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", 512 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
            *RECEIVER_OPTIONS,  # the shippers' keepalive pings are welcome
        ],
        interceptors=[server_interceptor(auth)] if auth.closed else None,  # TLS alone: commands refused
    )
    server.add_generic_rpc_handlers(service.handlers())
    from collector.control import loop as control_loop

    control, control_servicer = control_loop.make_service(con, config.command_ttl_s)
    pb_grpc.add_ControlServicer_to_server(control_servicer, server)
    service.commands_waiting = control.commands_waiting  # Push replies tell rank 0 when to poll
    committed = writer.on_commit

    def on_commit(batches) -> None:  # the control path learns each hooks' start's run and rank
        control.heard(batches)
        metrics.on_commit(batches)  # rows the shippers say were not stored (gap rows)
        if committed is not None:
            committed(batches)

    writer.on_commit = on_commit
    try:
        creds = auth.server_credentials()
        port = server.add_secure_port(bind, creds) if creds is not None else server.add_insecure_port(bind)
    except RuntimeError as e:
        if ends is not None:
            ends.close()
        writer.close()
        if live is not None:
            live.close()
        con.close()
        raise ListenError(f"cannot listen on {listen}: {e}") from e
    if not bind.startswith("unix:"):
        host = bind.rpartition(":")[0]
        address = f"{host}:{port}"
    else:
        address = bind
    await server.start()
    http = None
    metrics_port = config.metrics_port
    if metrics_port is not None:
        http, _ = serve_metrics(metrics_port, metrics.registry, auth=auth)
        metrics_port = http.server_port
    exports.start_otlp(gauges_fn or no_gauges, alerts_fn or no_alerts)
    tasks = control_loop.start_tasks(control, con, config.controller, live=live, sinks=[*alert_sinks, exports])
    name_os_threads()
    return Collector(server, service, writer, con, address, db_path, metrics, metrics_port, http, exports, live,
                     control, tasks, ends)


def name_os_threads() -> None:
    """Give the collector's threads their names in the OS too (``top -H``, /proc/PID/task/*/comm), so
    CPU per thread can be read from outside (`tracetop bench ingest` reports it): Python 3.11 leaves
    every thread named as the process. The main thread keeps the process's name; threads DuckDB or
    gRPC made keep theirs. Linux only; elsewhere, or refused, nothing happens."""
    import os

    for t in threading.enumerate():
        tid = t.native_id
        if tid is None or tid == os.getpid() or not t.is_alive():
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm", "w") as f:
                f.write(t.name[:15])
        except OSError:
            pass


def watch_source_ends(writer: Writer, after_s: float | None, con=None):
    """collector/ingest/source_ends.py: a GAP row for each rank source gone silent without a clean close
    (after ``after_s``; None: the default; 0: off). Its rows go through the writer like any batch."""
    from collector.ingest.source_ends import DEFAULT_AFTER_S, SourceEnds

    if after_s is not None and after_s <= 0:
        return None
    ends = SourceEnds(after_s=after_s if after_s is not None else DEFAULT_AFTER_S)
    if con is not None:
        ends.attach(con)  # the watch outlives a restart (sources heard before it still get their row)
    live_commit = writer.on_commit

    def on_commit(batches) -> None:
        ends.on_commit(batches)
        if live_commit is not None:
            live_commit(batches)

    writer.on_commit = on_commit

    class _NoAcks(StreamReplies):
        def deliver(self, item) -> None:
            pass

    no_acks = _NoAcks()

    def submit(raw) -> bool:
        got = receive(raw)
        if isinstance(got, Rejection):  # a bug of ours: say so, write nothing
            log.error("collector: own GAP batch refused: %s: %s", got.fault, got.message)
            return False
        return writer.submit(QueuedBatch(no_acks, got, batch_to_arrow(got)))

    return ends.start(submit)


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


def serve(config: CollectorConfig, **collaborators) -> Handle:
    """Start a collector in a background thread and return once it listens; ``collaborators``
    are `start`'s keyword arguments."""
    loop = asyncio.new_event_loop()
    ready: dict[str, object] = {}
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            ready["c"] = loop.run_until_complete(start(config, **collaborators))
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
