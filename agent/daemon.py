"""The agent process: wires the samplers, the relay, the clock probe and the metrics endpoint to
one shipper (with the disk spool) that talks to the collector.

Every piece is injectable (NVML backend, psutil, clocks, the shipper class) so tests and the
benchmark run the real thing against a fake GPU edge.
"""

from __future__ import annotations

import logging
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from agent.clock import ClockProbe, ClockSample, clock_offset_columns, grpc_exchange
from agent.gpu import GPUSampler, XidWatcher, xid_columns
from agent.host import HostSampler
from agent.metrics import AgentMetrics
from agent.nvml import NVML, NVMLUnavailable
from agent.relay import Relay
from tracetop import env
from tracetop.events import Kind
from tracetop.wire.shipper import NullShipper, Sink

log = logging.getLogger("tracetop.agent")

MiB = 1 << 20


def safe_id(text: str, limit: int = 64) -> str:
    """Text made fit for a source/run id ([A-Za-z0-9._:-])."""
    return (re.sub(r"[^A-Za-z0-9._:\-]", "-", text) or "node")[:limit]


@dataclass
class AgentConfig:
    collector: str
    listen: list[str] = field(default_factory=lambda: [env.default_agent_socket()])
    interval_s: float = 1.0
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    #: who may scrape /metrics (tracetop.wire.auth.ServerAuth: a token, TLS); None: anyone on loopback
    metrics_auth: Any = None
    spool_dir: str = env.DEFAULT_SPOOL_DIR
    spool_max_bytes: int = 1024 * MiB
    run_id: str | None = None
    node: str | None = None
    clock_interval_s: float = 60.0
    spool_fsync: bool = True
    #: Sealing interval of the agent's own rows (tracetop.env.AGENT_FLUSH_S: 1 s matches 1 Hz
    #: sampling and keeps the flusher's wake-ups cheap; hook batches are forwarded at once).
    flush_interval_s: float = env.AGENT_FLUSH_S
    #: how the agent proves itself to a collector that demands it (tracetop.wire.auth.ClientAuth)
    auth: Any = None


def shipper_auth_kwargs(auth: Any) -> dict[str, Any]:
    """The shipper's TLS credentials and bearer metadata from a ClientAuth (nothing without one)."""
    if auth is None:
        return {}
    return {"channel_credentials": auth.channel_credentials(), "call_metadata": auth.metadata() or None,
            "channel_options": auth.channel_options() or None}


class PidRanks:
    """pid -> trainer rank on this node: learnt from the hooks' RUN_START and HEARTBEAT rows passing
    through the relay, else from the process's RANK environment variable (torchrun sets it)."""

    def __init__(self, psutil_mod: Any = None) -> None:
        self._known: dict[int, int] = {}
        self._env_cache: dict[int, int] = {}
        self._psutil = psutil_mod
        self._lock = threading.Lock()

    def learn(self, batch: Any) -> None:
        if batch.kind not in (Kind.RUN_START, Kind.HEARTBEAT) or not batch.n:
            return
        pids, ranks = batch.columns["pid"], batch.columns["rank"]
        with self._lock:
            self._known.update(zip(pids.tolist(), ranks.tolist()))

    def __call__(self, pid: int) -> int:
        with self._lock:
            r = self._known.get(pid)
            if r is None:
                r = self._env_cache.get(pid)
        if r is not None:
            return r
        r = -1
        try:
            if self._psutil is None:
                import psutil

                self._psutil = psutil
            value = self._psutil.Process(pid).environ().get("RANK", "")
            r = int(value) if value.lstrip("-").isdigit() else -1
        except Exception:  # gone, or not ours to read
            r = -1
        with self._lock:
            self._env_cache[pid] = r
        return r


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        *,
        nvml_backend: Any = None,
        psutil_mod: Any = None,
        shipper_factory: Callable[..., Sink] | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        mono_s: Callable[[], float] = time.monotonic,
        out: TextIO | None = None,
    ) -> None:
        self.cfg = cfg
        self.node = cfg.node or socket.gethostname()
        self.run_id = cfg.run_id or env.get(env.TRACETOP_RUN_ID) or f"agent-{safe_id(self.node)}"
        self.source_id = f"agent:{safe_id(self.node, 48)}:{uuid.uuid4().hex[:12]}"
        self.clock_ns = clock_ns
        self.mono_s = mono_s
        self.out = out if out is not None else sys.stderr
        self._nvml_backend = nvml_backend
        self._psutil = psutil_mod
        if shipper_factory is None:
            from tracetop.wire.shipper import Shipper

            shipper_factory = Shipper
        self._shipper_factory = shipper_factory
        self.shipper: Sink = NullShipper()  # the real one from start()
        self.nvml: NVML | None = None
        self.gpu: GPUSampler | None = None
        self.host: HostSampler | None = None
        self.xid: XidWatcher | None = None
        self.relay: Relay | None = None
        self.clock: ClockProbe | None = None
        self.metrics: AgentMetrics | None = None
        self.metrics_port: int | None = None
        self.pid_ranks = PidRanks(psutil_mod)
        self.nvml_notice: str | None = None
        self._counts = {"xid_events": 0, "samples": 0}
        self._stop = threading.Event()
        self._close_clock: Callable[[], None] | None = None

    # ---- lifecycle ----
    def start(self) -> Agent:
        cfg = self.cfg
        self.shipper = self._shipper_factory(
            cfg.collector,
            run_id=self.run_id,
            source_id=self.source_id,
            spool_dir=cfg.spool_dir,
            spool_max_bytes=cfg.spool_max_bytes,
            spool_fsync=cfg.spool_fsync,
            flush_interval_s=cfg.flush_interval_s,
            **shipper_auth_kwargs(cfg.auth),
        )
        self.nvml = NVML(self._nvml_backend)
        try:
            self.nvml.start()
            self.gpu = GPUSampler(self.nvml, self.node, clock_ns=self.clock_ns, rank_of_pid=self.pid_ranks)
        except NVMLUnavailable as e:
            self.nvml = None
            self.nvml_notice = (
                f"tracetop agent: NVML unavailable ({e.reason}): sampling host metrics only; {e.hint}"
            )
            print(self.nvml_notice, file=self.out, flush=True)
        self.host = HostSampler(
            self.node, psutil_mod=self._psutil, clock_ns=self.clock_ns, mono_s=self.mono_s
        )
        self.metrics = AgentMetrics(self.node, stats=self.stats)
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.metrics_addr, cfg.metrics_auth)
        if self.nvml is not None:
            self.xid = XidWatcher(self.nvml, self._on_xid, clock_ns=self.clock_ns).start()
        self.relay = Relay(
            self.shipper,
            cfg.listen,
            on_batch=self.pid_ranks.learn,
            clock_ns=self.clock_ns,
            high_water=getattr(self.shipper, "replayed_high_water", {}),
            control_target=cfg.collector,
            control_auth=cfg.auth,
        ).start()
        if cfg.clock_interval_s > 0:
            exchange, self._close_clock = grpc_exchange(cfg.collector, auth=cfg.auth)
            self.clock = ClockProbe(
                exchange, self._on_clock, interval_s=cfg.clock_interval_s, clock_ns=self.clock_ns
            ).start()
        return self

    def run(self, stop: threading.Event | None = None) -> None:
        """Sample every interval until `stop` (or self.stop()) is set."""
        stop = stop or self._stop
        next_t = self.mono_s()
        while not stop.is_set() and not self._stop.is_set():
            self.sample_once()
            next_t += self.cfg.interval_s
            delay = next_t - self.mono_s()
            if delay < 0:  # fell behind (suspended, overloaded): do not burst to catch up
                next_t = self.mono_s()
                delay = 0
            stop.wait(delay)

    def sample_once(self) -> None:
        """One interval: every GPU, then the host; columns built once, recorded in bulk."""
        try:
            gpu = proc = None
            if self.gpu is not None:
                gpu, proc = self.gpu.sample()
                self.shipper.record_many(Kind.GPU_SAMPLE, gpu)
                self.shipper.record_many(Kind.GPU_PROCESS, proc)
            host = self.host.sample() if self.host is not None else None
            if host is not None:
                self.shipper.record_many(Kind.HOST_SAMPLE, host)
            if self.metrics is not None:
                self.metrics.update(gpu=gpu, proc=proc, host=host)
            self._counts["samples"] += 1
        except Exception:  # a sampler fault must not stop the relay or the next interval
            log.exception("tracetop agent: sampling failed (continuing)")

    def stop(self, flush_timeout_s: float = 3.0) -> None:
        self._stop.set()
        if self.relay is not None:
            self.relay.stop()
        if self.clock is not None:
            self.clock.stop()
        if self._close_clock is not None:
            self._close_clock()
        if self.xid is not None:
            self.xid.stop()
        if self.nvml is not None:
            self.nvml.stop()
        if self.metrics is not None:
            self.metrics.close()
        self.shipper.close(flush_timeout_s)  # whatever is unacked stays on the spool

    # ---- consumers ----
    def _on_xid(self, t_ns: int, gpu: int, xid: int) -> None:
        self._counts["xid_events"] += 1
        log.warning("tracetop agent: XID %d on GPU %d", xid, gpu)
        self.shipper.record_many(Kind.XID, xid_columns(self.node, [(t_ns, gpu, xid)]))

    def _on_clock(self, s: ClockSample) -> None:
        self.shipper.record_many(Kind.CLOCK_OFFSET, clock_offset_columns(self.node, s))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._counts)
        if self.relay is not None:
            out.update(self.relay.stats())
        if self.shipper is not None:
            s = self.shipper.stats()
            out["spool_bytes"] = s.get("spool_bytes", 0)
            out["unacked_batches"] = s.get("unacked_batches", 0)
            out["collector_connected"] = 1 if s.get("connected") else 0
        if self.clock is not None and self.clock.last is not None:
            out["clock_offset_ns"] = self.clock.last.offset_ns
            out["clock_rtt_ns"] = self.clock.last.rtt_ns
        return out
