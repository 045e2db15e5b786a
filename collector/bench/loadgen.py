"""Load generation for the collector benchmarks: a real collector process and real shipper processes.

A source process ships STEP rows in bulk (``record_many``), the way a node's agent forwarding many
ranks would, so the figures measure the collector and the wire, not Python call overhead in the
sources. Every row is identifiable — ``rank`` = source index, ``step`` = row number — so a test can
count exactly what was stored, lost, or stored twice.

Run a source by hand: ``python -m collector.bench.loadgen --endpoint ADDR --source 3 --events 100000``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHUNK_ROWS = 16384
#: A source waits (rather than letting its shipper drop the oldest) while this many chunks are unacked.
MAX_INFLIGHT_BATCHES = 1


def run_source(
    endpoint: str,
    run_id: str,
    source: int,
    events: int,
    chunk_rows: int = CHUNK_ROWS,
    rate_eps: float = 0.0,
    start_file: str | None = None,
    trainer_like: bool = False,
    buffer_bytes: int | None = None,
    window: int = MAX_INFLIGHT_BATCHES,
) -> dict:
    """Ship `events` STEP rows tagged (rank=source, step=0..events-1); return the shipper's stats.

    With start_file: once set up (imports done, shipper started), create `<start_file>.ready.<source>`
    and wait until start_file exists, so a benchmark can start every source at once and leave
    interpreter start-up out of its window.

    trainer_like: behave as a training loop does: never wait for acks (the shipper must buffer,
    spill or drop and count), and time each hand-over to the shipper; the stats then carry
    ``record_ms_p50/p99/max``, what telemetry cost the "training" thread per step.

    window: otherwise, the chunks that may be unacked when the source records the next one."""
    import numpy as np

    from tracetop.events import SCHEMAS, Kind
    from tracetop.wire.shipper import Shipper

    # A load source sends without pause, like a busy agent relay: its stream stays open between
    # its paced batches (a 1 s linger) and ends only when it is done, so a killed collector
    # breaks a live stream rather than falling between two bursts.
    extra = {"max_unacked_bytes": buffer_bytes} if buffer_bytes else {}
    shipper = Shipper(endpoint, run_id=run_id, source_id=f"loadgen-{source}-{os.getpid()}", rank=source,
                      burst_linger_s=1.0, **extra)
    names = [c.name for c in SCHEMAS[Kind.STEP]]
    if start_file:
        Path(f"{start_file}.ready.{source}").touch()
        while not os.path.exists(start_file):
            time.sleep(0.005)
    acks = _AckedRows(shipper)
    t0, cpu0 = time.monotonic(), time.process_time()
    sent = most_unacked = 0
    record_s: list[float] = []
    while sent < events:
        n = min(chunk_rows, events - sent)
        if not trainer_like:
            acks.wait_until_unacked(sent, chunk_rows, window)
            most_unacked = max(most_unacked, sent - acks.rows)
        steps = np.arange(sent, sent + n, dtype="<i8")
        now = time.time_ns()
        cols = {name: steps for name in names}
        cols["rank"] = np.full(n, source, dtype="<i4")
        cols["start_ns"] = np.full(n, now, dtype="<i8")
        r0 = time.perf_counter()
        shipper.record_many(Kind.STEP, cols)
        record_s.append(time.perf_counter() - r0)
        sent += n
        if rate_eps > 0:
            ahead = sent / rate_eps - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    ok = shipper.flush(timeout_s=600)
    stats = shipper.stats()
    shipper.close(timeout_s=5)
    stats.update(sent=sent, flushed=ok, source=source, elapsed_s=time.monotonic() - t0, cpu_s=time.process_time() - cpu0,
                 most_unacked_rows=most_unacked)
    if record_s:
        q = np.quantile(np.array(record_s), [0.5, 0.99])
        stats.update(record_ms_p50=float(q[0]) * 1e3, record_ms_p99=float(q[1]) * 1e3,
                     record_ms_max=max(record_s) * 1e3)
    return stats


class _AckedRows:
    """A source's acked rows, counted from the shipper's ack callback, so the source waits on a
    condition rather than polling ``stats()`` every 2 ms (~70 us a call): with 8 sources beside the
    collector on two cores the polling cost the sources ~20% more CPU, and each ack was seen up to
    2 ms late (p99 record -> commit 717 -> 422 ms at the same rate; docs/benchmarks.md)."""

    def __init__(self, shipper) -> None:
        import threading

        self.shipper = shipper
        self.rows = 0
        self.cv = threading.Condition()
        shipper.on_acked(self._acked)

    def _acked(self, kind, rows: int) -> None:
        with self.cv:
            self.rows += rows
            self.cv.notify()

    def wait_until_unacked(self, sent: int, chunk_rows: int, chunks: int) -> None:
        """Until at most ``chunks`` chunks of the ``sent`` rows are unacked. A batch the shipper drops
        is never acked, so every second its own counts (unacked batches, pending rows) decide too."""
        with self.cv:
            while sent - self.rows > chunks * chunk_rows:
                if not self.cv.wait(1.0):
                    st = self.shipper.stats()
                    if st["unacked_batches"] + st["pending_rows"] // chunk_rows <= chunks:
                        return


class CollectorProcess:
    """`tracetop collector` as a child process on a given file and address, killable and restartable."""

    def __init__(self, db: Path, listen: str, extra_args: tuple[str, ...] = ()) -> None:
        from tracetop import procs

        self.db = db
        self.listen = listen
        self.log_path = db.with_suffix(".collector.log")
        self.service = procs.collector(db, listen, extra_args=extra_args, log_path=self.log_path)

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.service.proc

    def start(self, timeout_s: float = 60.0) -> None:
        self.service.start(timeout_s)

    def kill(self) -> None:
        self.service.kill()

    def stop(self, timeout_s: float = 60.0) -> int:
        try:
            return self.service.stop(timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            return self.service.proc.returncode  # type: ignore[union-attr]


def wait_ready(address: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    import grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"collector exited with code {proc.returncode} before listening on {address}")
        channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
            return
        except grpc.FutureTimeoutError:
            pass
        finally:
            channel.close()
    raise TimeoutError(f"nothing listening on {address} after {timeout_s} s")


#: The load sources' allocator: glibc keeps freed memory instead of giving each freed batch's
#: megabytes back to the kernel and faulting them in again for the next one (~30% of a source's
#: CPU; docs/benchmarks.md, "the allocator's churn"). The sources share the machine with the
#: collector they measure, so what they spend is taken from it. Trainer-like sources keep glibc's
#: defaults (they stand for a training process, whose allocator is the user's), and an environment
#: that sets GLIBC_TUNABLES itself, even empty (the defaults), wins.
SOURCE_MALLOC = ("glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=67108864:"
                 "glibc.malloc.top_pad=134217728")


def source_env(trainer_like: bool = False) -> dict[str, str]:
    """A load source's environment: this process's, with SOURCE_MALLOC unless trainer-like."""
    env = dict(os.environ)
    if not trainer_like:
        env.setdefault("GLIBC_TUNABLES", SOURCE_MALLOC)
    return env


def start_sources(
    endpoint: str, run_id: str, sources: int, events: int, rate_eps: float = 0.0, start_file: Path | None = None,
    *, trainer_like: bool = False, chunk_rows: int = CHUNK_ROWS, buffer_bytes: int | None = None,
    window: int = MAX_INFLIGHT_BATCHES,
) -> list[subprocess.Popen]:
    """Launch the source processes. With start_file they get ready and wait; call release(start_file)."""
    extra = ["--start-file", str(start_file)] if start_file else []
    extra += ["--trainer-like"] if trainer_like else []
    extra += ["--chunk-rows", str(chunk_rows), "--window", str(window)]
    extra += ["--buffer-bytes", str(buffer_bytes)] if buffer_bytes else []
    return [
        subprocess.Popen(
            [sys.executable, "-m", "collector.bench.loadgen", "--endpoint", endpoint, "--run-id", run_id,
             "--source", str(i), "--events", str(events), "--rate-eps", str(rate_eps), *extra],
            stdout=subprocess.PIPE,
            text=True,
            env=source_env(trainer_like),
        )
        for i in range(sources)
    ]


def release(start_file: Path, procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    """Wait until every source is set up, then let them all go at once."""
    deadline = time.monotonic() + timeout_s
    for i, p in enumerate(procs):
        while not Path(f"{start_file}.ready.{i}").exists():
            if p.poll() is not None:
                raise RuntimeError(f"load source {i} exited {p.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"load source {i} not ready after {timeout_s} s")
            time.sleep(0.01)
    start_file.touch()


def collect_sources(procs: list[subprocess.Popen], timeout_s: float = 900) -> list[dict]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"load source exited {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def count_stored(db: Path, run_id: str, relay_run_ids: tuple[str, ...] = ()) -> dict:
    """Exactly-once accounting over the STEP table: per source (rank), distinct and total rows."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(
            "SELECT rank, count(*) AS stored, count(DISTINCT step) AS distinct_steps FROM step WHERE run_id = ? GROUP BY rank",
            [run_id],
        ).fetchall()
        # rows recorded as lost; a relay (agent) records drops of the sources' rows under its own run id.
        # (Files from before the fix may hold `spool_full` rows: refusals, not losses; left out.)
        runs = [run_id, *relay_run_ids]
        marks = ", ".join("?" * len(runs))
        gaps = con.execute(f"SELECT coalesce(sum(dropped), 0) FROM gap WHERE run_id IN ({marks}) AND kind = 'step' "
                           "AND reason <> 'spool_full'", runs).fetchone()[0]
    finally:
        con.close()
    return {"per_source": {int(r): (int(s), int(d)) for r, s, d in rows}, "gaps_dropped": int(gaps)}


#: What one rank sends per step in a "realistic" mix (issue: hardening, the 16,384-rank bench):
#: rows per rank-step by kind. GPU samples come at 1 Hz per 8 ranks, heartbeats every 5 s per rank.
MIX_PER_RANK_STEP = {"STEP": 1, "COLLECTIVE": 20, "PIPE_INSTR": 16, "MEMORY": 1, "THROUGHPUT": 1}
MIX_GPU_HZ_PER_8_RANKS = 1.0
MIX_HEARTBEAT_S = 5.0


def mix_template(kind, first_rank: int, ranks: int, per_rank: int) -> dict:
    """Columns for `ranks` ranks × `per_rank` rows of one kind; strings as (codes, dictionary)."""
    import numpy as np

    from tracetop.events import SCHEMAS

    n = ranks * per_rank
    rank = np.repeat(np.arange(first_rank, first_rank + ranks, dtype="<i4"), per_rank)
    cols: dict = {}
    for col in SCHEMAS[kind]:
        if col.name == "rank":
            cols["rank"] = rank
        elif col.dtype == "str":
            cols[col.name] = (np.arange(n, dtype="<i4") % 4, [f"{col.name}-{i}" for i in range(4)])
        elif col.dtype == "f8":
            cols[col.name] = np.linspace(0.0, 1.0, n)
        else:
            cols[col.name] = (np.arange(n) % 1000 + 1).astype("<" + col.dtype)
    return cols


def healthy_memory_and_gpus(memory: dict, gpus: dict) -> None:
    """The mix's MEMORY and GPU_SAMPLE columns as healthy 80 GB GPUs report them: 40 GiB allocated of an
    80 GiB budget, no ECC error, no remap, no throttling, 65 C of a 90 C slowdown. The template's
    counting numbers (1..1000 bytes of a 1..1000-byte budget, 1..1000 ECC errors) fired 4,096 `memory`,
    255 `ecc` and 255 `hardware_risk` alerts re-stored every step: an alert storm, not the usual load."""
    import numpy as np

    gib = 2**30
    n = len(memory["rank"])
    for name, value in (("allocated_bytes", 40 * gib), ("reserved_bytes", 44 * gib), ("peak_bytes", 42 * gib),
                        ("rss_bytes", 8 * gib), ("budget_bytes", 80 * gib)):
        memory[name] = np.full(n, value, "<i8")
    n = len(gpus["rank"])
    for name, value in (("util_pct", 95.0), ("mem_util_pct", 60.0), ("mem_used_bytes", 44.0 * gib),
                        ("mem_total_bytes", 80.0 * gib), ("power_mw", 500_000.0), ("temp_c", 65.0),
                        ("sm_clock_mhz", 1980.0), ("clock_event_reasons", 0.0), ("ecc_uncorrected", 0.0),
                        ("remapped_rows", 0.0), ("ecc_corrected", 0.0), ("remap_pending", 0.0),
                        ("remap_failure", 0.0), ("pcie_replays", 0.0), ("pcie_correctable", 0.0),
                        ("temp_slowdown_c", 90.0), ("power_limit_mw", 700_000.0)):
        gpus[name] = np.full(n, value, "<f8")


def run_mix_source(endpoint: str, run_id: str, source: int, first_rank: int, ranks: int, step_s: float,
                   duration_s: float, start_file: str | None = None) -> dict:
    """Ship the realistic per-rank-step mix of `ranks` ranks (first_rank..) every `step_s` for
    `duration_s`, as the hooks of those ranks would (never waiting for acks). Reports what was sent
    and how far the source fell behind its schedule (it shares the machine with the collector)."""
    import numpy as np

    from tracetop.events import Kind
    from tracetop.wire.shipper import Shipper

    shipper = Shipper(endpoint, run_id=run_id, source_id=f"mix-{source}-{os.getpid()}", rank=first_rank,
                      burst_linger_s=1.0)
    templates = {getattr(Kind, k): mix_template(getattr(Kind, k), first_rank, ranks, per)
                 for k, per in MIX_PER_RANK_STEP.items()}
    gpus = max(1, ranks // 8)
    gpu_t = mix_template(Kind.GPU_SAMPLE, first_rank, gpus, 1)
    hb_t = mix_template(Kind.HEARTBEAT, first_rank, ranks, 1)
    # healthy ranks between collectives (the template's made-up op names "entered" in 1970 made every
    # rank stuck, and the live engine judged 16,384 hangs a tick: an alert storm, not the usual load)
    hb_t.update(phase=(np.zeros(ranks, "<i4"), ["forward"]), pending_op=(np.zeros(ranks, "<i4"), [""]),
                pending_role=(np.zeros(ranks, "<i4"), [""]), pending_since_ns=np.full(ranks, -1, "<i8"))
    healthy_memory_and_gpus(templates[Kind.MEMORY], gpu_t)
    if start_file:
        Path(f"{start_file}.ready.{source}").touch()
        while not os.path.exists(start_file):
            time.sleep(0.005)
    sent: dict[str, int] = {}
    t0, cpu0 = time.monotonic(), time.process_time()
    next_gpu = next_hb = t0
    step, late, max_lag = 0, 0, 0.0

    def ship(kind, cols: dict, step_no: int) -> None:
        n = len(cols["rank"])
        cols["step"] = np.full(n, step_no, "<i8")
        cols["start_ns"] = np.full(n, time.time_ns(), "<i8")
        shipper.record_many(kind, cols)
        sent[kind.name.lower()] = sent.get(kind.name.lower(), 0) + n

    while True:
        due = t0 + step * step_s
        now = time.monotonic()
        if due - t0 >= duration_s:
            break
        if now < due:
            time.sleep(due - now)
        else:
            lag = now - due
            max_lag = max(max_lag, lag)
            late += lag > step_s
        for kind, cols in templates.items():
            ship(kind, cols, step)
        now = time.monotonic()
        if now >= next_gpu:
            ship(Kind.GPU_SAMPLE, gpu_t, -1)
            next_gpu += 1.0 / MIX_GPU_HZ_PER_8_RANKS
        if now >= next_hb:
            ship(Kind.HEARTBEAT, hb_t, step)
            next_hb += MIX_HEARTBEAT_S
        step += 1
    elapsed = time.monotonic() - t0
    ok = shipper.flush(timeout_s=600)
    stats = shipper.stats()
    shipper.close(timeout_s=5)
    stats.update(sent=sum(sent.values()), sent_by_kind=sent, steps=step, late_steps=late, max_lag_s=round(max_lag, 3),
                 flushed=ok, source=source, elapsed_s=elapsed, cpu_s=time.process_time() - cpu0)
    return stats


def start_mix_sources(endpoint: str, run_id: str, sources: int, ranks: int, step_s: float, duration_s: float,
                      start_file: Path) -> list[subprocess.Popen]:
    share = [ranks // sources + (1 if i < ranks % sources else 0) for i in range(sources)]
    firsts = [sum(share[:i]) for i in range(sources)]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "collector.bench.loadgen", "--endpoint", endpoint, "--run-id", run_id, "--source", str(i),
             "--mix-ranks", str(share[i]), "--mix-first-rank", str(firsts[i]), "--mix-step-s", str(step_s),
             "--mix-duration-s", str(duration_s), "--events", "0", "--start-file", str(start_file)],
            stdout=subprocess.PIPE, text=True, env=source_env(),
        )
        for i in range(sources)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description="one load source (used by tracetop bench ingest/chaos)")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--run-id", default="bench")
    p.add_argument("--source", type=int, required=True)
    p.add_argument("--events", type=int, required=True)
    p.add_argument("--rate-eps", type=float, default=0.0, help="events/s pacing; 0 = as fast as acks allow")
    p.add_argument("--start-file", default=None, help="get ready, then wait until this file exists")
    p.add_argument("--trainer-like", action="store_true", help="never wait for acks; time each hand-over")
    p.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS, help="rows per hand-over (one 'step')")
    p.add_argument("--buffer-bytes", type=int, default=None, help="the shipper's unacked budget")
    p.add_argument("--window", type=int, default=MAX_INFLIGHT_BATCHES,
                   help="chunks that may be unacked when the next is recorded (not with --trainer-like)")
    p.add_argument("--mix-ranks", type=int, default=0, help="ship the realistic mix of this many ranks instead")
    p.add_argument("--mix-first-rank", type=int, default=0)
    p.add_argument("--mix-step-s", type=float, default=1.0)
    p.add_argument("--mix-duration-s", type=float, default=60.0)
    a = p.parse_args()
    if a.mix_ranks:
        stats = run_mix_source(a.endpoint, a.run_id, a.source, a.mix_first_rank, a.mix_ranks, a.mix_step_s,
                               a.mix_duration_s, start_file=a.start_file)
        print(json.dumps(stats), flush=True)
        return
    stats = run_source(a.endpoint, a.run_id, a.source, a.events, chunk_rows=a.chunk_rows, rate_eps=a.rate_eps,
                       start_file=a.start_file, trainer_like=a.trainer_like, buffer_bytes=a.buffer_bytes,
                       window=a.window)
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
