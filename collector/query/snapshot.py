"""A run's compact snapshot: what Query.Watch streams and what the TUI renders from.

A snapshot is a few small named Arrow tables about one step of one run (the latest complete step
live, any step when a file is replayed) and the few steps before it, plus a JSON header. It is
built by bounded queries only (every event table is read `WHERE step BETWEEN lo AND hi`, node
samples by a time window), so its cost does not grow with the file.

One definition, two users: the collector (collector/query/watch.py, on its own cursor) and the TUI's
FileSource (on a read-only connection to a finished run's file) both call `build`; the TUI's
CollectorSource receives the same tables through Watch and asks for a rank's detail with
`rank_detail_sql` through Query.Sql. Nothing here imports another package of ours.

Wire form (Snapshot.arrow_ipc): one Arrow IPC stream of a table with columns `name` (utf8) and
`ipc` (binary, each an Arrow IPC stream of that section), schema metadata `tracetop_snapshot`
(FORMAT) and `header` (JSON).

Sections (columns; times in ms unless a name says otherwise):
- ranks: rank, stage, replica, tp_rank, node, step_ms, compute_ms, wait_ms (time inside
  collectives), data_wait_ms, forward_ms, backward_ms, optimizer_ms, comm_exposed_ms, mem_bytes
  (device allocated, else RSS), mem_budget_bytes, gpu_util_pct, reported (1 if the rank has a
  row at this step)
- steps: per step over the window: step, ranks, step_ms_p50, step_ms_max, data_wait_ms,
  forward_ms, backward_ms, optimizer_ms, comm_exposed_ms, compute_ms (means over ranks),
  tokens, samples (sums), tokens_per_s, mfu, grad_sync_ms_p99
- bubble: stage, step, bubble_rate, ideal_bubble_rate (the bubble_by_stage view's definition)
- gantt: the snapshot step's pipeline instructions on the first rank of each stage: stage, rank,
  micro_batch, instr, start_ms (from the step's first instruction), duration_ms
- collectives: op, role, size_bucket_bytes (power of two at or below), calls, bytes_p50,
  duration_ms_p50, duration_ms_p99, algbw_gbps, busbw_gbps over the window
- offload_rate: step, direction, bytes, gbps; offload_last: the last 10 transfers at or before the
  step: start_ns, rank, direction, what, bytes, duration_ms
- gpus: the latest sample per (node, gpu) at or before the step's end (agent rows): the run's own,
  and those of any agent on the run's nodes (an agent ships under its own run id, e.g. the demo's
  `<run>-agent`, so a replay matches its GPUs by node and time, not by run id); xids likewise
- topology: the comm_topology view (collector/query/dashboard.py) over the collectives section's steps
- gpu_risk: the hardware_risk view over the run's nodes' agent samples of the RISK_WINDOW_S before
  the step's end; empty in a watcher's (live) snapshot
- fragmentation: rank, step, frag_bytes, frag_share, measured over the window (the
  memory_fragmentation view: reserved - allocated on GPU; NULL on CPU)
- alerts / actions: the live engine's and controller's rows for the run where those tables exist
- lost: GPU time lost (collector/query/lost_sql.py, the lost_time view's text) over the steps that ended in
  the LOST_WINDOW_S before the snapshot step's end (at most LOST_WINDOW_STEPS steps): a row with
  rank NULL for the totals, then the ranks charged the most; by cause, GPU-ms; steps, first_end_ns,
  last_end_ns. Files of schema 5 and later (it reads step_ranks).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from collector.query import dashboard
from tracetop.errors import TracetopError

FORMAT = "1"
#: The newest collector file schema (collector/ingest/schema.py STORE_VERSION) this SQL was written
#: against; a file of a newer schema is refused by the TUI. tests/tui/test_sources.py holds the two
#: equal, so a migration makes whoever adds it look here.
MAX_STORE_VERSION = 17
#: Steps before the snapshot's step that its per-step sections cover.
DEFAULT_WINDOW_STEPS = 30
#: Steps the collectives section covers (the heaviest: every call of every rank).
COLLECTIVE_WINDOW_STEPS = 5
#: Seconds of agent samples before the step's end that count as "now" for the GPU tiles.
GPU_WINDOW_S = 10.0
#: Agent history the GPUs screen's risk column reads before the step's end (a replay).
RISK_WINDOW_S = 24 * 3600.0
#: The lost-time line: step time before the step's end it covers, and at most this many steps.
LOST_WINDOW_S = 600.0
LOST_WINDOW_STEPS = 200
#: A watcher's first snapshot reads this many steps of lost time (then each new step once).
LOST_FIRST_STEPS = 5

# execute(sql, params) -> pyarrow.Table
Execute = Callable[[str, list], Any]


class SnapshotError(TracetopError):
    """A snapshot cannot be built or read; str() says what and what to do."""


@dataclass(frozen=True)
class Snapshot:
    """Plain data: the header and the named sections (pyarrow tables)."""

    header: Mapping[str, Any]
    tables: Mapping[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.header.get("step", -1))

    def table(self, name: str):
        import pyarrow as pa

        t = self.tables.get(name)
        return t if t is not None else pa.table({})


# ---- encode / decode -----------------------------------------------------------------------

def _ipc(table) -> bytes:
    import pyarrow as pa

    buf = pa.BufferOutputStream()
    with pa.ipc.new_stream(buf, table.schema) as w:
        w.write_table(table)
    return buf.getvalue().to_pybytes()


def from_ipc(data: bytes):
    import pyarrow as pa

    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def encode(snap: Snapshot) -> bytes:
    import pyarrow as pa

    names = list(snap.tables)
    outer = pa.table(
        {"name": pa.array(names, pa.string()), "ipc": pa.array([_ipc(snap.tables[n]) for n in names], pa.binary())}
    )
    outer = outer.replace_schema_metadata({"tracetop_snapshot": FORMAT, "header": json.dumps(dict(snap.header))})
    return _ipc(outer)


def decode(data: bytes) -> Snapshot:
    try:
        outer = from_ipc(data)
    except Exception as e:
        raise SnapshotError(f"snapshot is not an Arrow IPC stream ({e}); the collector and tracetop disagree, "
                            "use the same tracetop version on both") from e
    meta = outer.schema.metadata or {}
    fmt = meta.get(b"tracetop_snapshot", b"").decode()
    if fmt != FORMAT:
        raise SnapshotError(f"snapshot format {fmt or 'missing'}, this tracetop reads {FORMAT}; "
                            "use the same tracetop version for the collector and the TUI")
    header = json.loads(meta.get(b"header", b"{}"))
    tables = {n: from_ipc(b) for n, b in zip(outer.column("name").to_pylist(), outer.column("ipc").to_pylist())}
    return Snapshot(header, tables)


# ---- the bounded queries -------------------------------------------------------------------

RUN_SQL = """
SELECT run_id, min(start_ns) AS started_ns, max(world_size) AS world_size, max(tp) AS tp, max(pp) AS pp,
       max(dp) AS dp, max(zero_stage) AS zero_stage, any_value(model_name) AS model_name,
       max(n_params) AS n_params, max(micro_batch) AS micro_batch, max(micro_batches) AS micro_batches,
       count(DISTINCT rank) AS ranks_started, count(DISTINCT hostname) AS nodes,
       any_value(ds_config_json) AS ds_config_json
FROM run_start WHERE run_id = ? GROUP BY run_id
"""

RUNS_SQL = "SELECT run_id, min(start_ns) AS started_ns FROM run_start GROUP BY run_id ORDER BY started_ns"

# Per-rank coordinates: ranks are laid out pipe-major, then data, then tensor (reference_trainer).
_RANKS_SQL = """
WITH r AS (
    SELECT rank, any_value(stage) AS stage, any_value(tp) AS tp, any_value(dp) AS dp,
           any_value(hostname) AS node
    FROM run_start WHERE run_id = $run GROUP BY rank
),
s AS (SELECT * FROM step WHERE run_id = $run AND step = $step),
c AS (SELECT rank, sum(duration_ns) AS wait_ns FROM collective
      WHERE run_id = $run AND step = $step GROUP BY rank),
m AS (SELECT rank, arg_max(CASE WHEN allocated_bytes >= 0 THEN allocated_bytes ELSE rss_bytes END, start_ns) AS mem,
             arg_max(budget_bytes, start_ns) AS budget
      FROM memory WHERE run_id = $run AND step BETWEEN $step - 1 AND $step GROUP BY rank),
g AS (SELECT node, gpu, arg_max(util_pct, start_ns) AS util FROM gpu_sample
      WHERE (run_id = $run OR node IN (SELECT hostname FROM run_start WHERE run_id = $run))
        AND start_ns BETWEEN $t_end_ns - $gpu_window_ns AND $t_end_ns GROUP BY node, gpu),
rl AS (SELECT rank, node, (row_number() OVER (PARTITION BY node ORDER BY rank)) - 1 AS local_rank FROM r)
SELECT r.rank, coalesce(r.stage, -1) AS stage,
       CAST((r.rank // greatest(r.tp, 1)) % greatest(r.dp, 1) AS INTEGER) AS replica,
       CAST(r.rank % greatest(r.tp, 1) AS INTEGER) AS tp_rank, r.node,
       s.duration_ns / 1e6 AS step_ms, s.compute_ns / 1e6 AS compute_ms, c.wait_ns / 1e6 AS wait_ms,
       s.data_wait_ns / 1e6 AS data_wait_ms, s.forward_ns / 1e6 AS forward_ms, s.backward_ns / 1e6 AS backward_ms,
       s.optimizer_ns / 1e6 AS optimizer_ms, s.comm_exposed_ns / 1e6 AS comm_exposed_ms,
       CAST(m.mem AS DOUBLE) AS mem_bytes, CAST(m.budget AS DOUBLE) AS mem_budget_bytes,
       g.util AS gpu_util_pct, CAST(s.rank IS NOT NULL AS INTEGER) AS reported
FROM r LEFT JOIN s ON s.rank = r.rank LEFT JOIN c ON c.rank = r.rank LEFT JOIN m ON m.rank = r.rank
LEFT JOIN rl ON rl.rank = r.rank LEFT JOIN g ON g.node = rl.node AND g.gpu = rl.local_rank
ORDER BY r.rank
"""

_STEPS_SQL = """
WITH s AS (SELECT * FROM step WHERE run_id = $run AND step BETWEEN $lo AND $step),
t AS (SELECT step, sum(tokens_per_s) FILTER (WHERE NOT isnan(tokens_per_s)) AS tps,
             avg(mfu) FILTER (WHERE NOT isnan(mfu)) AS mfu
      FROM throughput WHERE run_id = $run AND step BETWEEN $lo AND $step GROUP BY step),
gs AS (SELECT step, rank, sum(duration_ns) AS ns FROM collective
       WHERE run_id = $run AND step BETWEEN $lo AND $step AND role LIKE '%dp%' GROUP BY step, rank),
g AS (SELECT step, quantile_cont(ns, 0.99) / 1e6 AS grad_sync_ms_p99 FROM gs GROUP BY step)
SELECT s.step, count(*) AS ranks,
       quantile_cont(duration_ns, 0.5) / 1e6 AS step_ms_p50, max(duration_ns) / 1e6 AS step_ms_max,
       avg(data_wait_ns) / 1e6 AS data_wait_ms, avg(forward_ns) / 1e6 AS forward_ms,
       avg(backward_ns) / 1e6 AS backward_ms, avg(optimizer_ns) / 1e6 AS optimizer_ms,
       avg(comm_exposed_ns) / 1e6 AS comm_exposed_ms, avg(compute_ns) / 1e6 AS compute_ms,
       CAST(sum(tokens) AS BIGINT) AS tokens, CAST(sum(samples) AS BIGINT) AS samples,
       any_value(t.tps) AS tokens_per_s, any_value(t.mfu) AS mfu, any_value(g.grad_sync_ms_p99) AS grad_sync_ms_p99
FROM s LEFT JOIN t ON t.step = s.step LEFT JOIN g ON g.step = s.step
GROUP BY s.step ORDER BY s.step
"""

# The bubble_by_stage view's definition (collector/ingest/schema.py _v3), over the window only.
_BUBBLE_SQL = """
SELECT r.stage, s.step,
       1 - sum(s.forward_ns + s.backward_ns) / sum(s.duration_ns) AS bubble_rate,
       (max(r.pp) - 1) / (max(r.micro_batches) + max(r.pp) - 1) AS ideal_bubble_rate
FROM (SELECT * FROM step WHERE run_id = $run AND step BETWEEN $lo AND $step AND duration_ns > 0) s
JOIN run_start r ON r.run_id = s.run_id AND r.rank = s.rank
WHERE r.pp > 1
GROUP BY r.stage, s.step ORDER BY s.step, r.stage
"""

_GANTT_SQL = """
WITH firsts AS (SELECT stage, min(rank) AS rank FROM run_start WHERE run_id = $run GROUP BY stage),
p AS (SELECT p.* FROM pipe_instr p JOIN firsts f ON f.rank = p.rank
      WHERE p.run_id = $run AND p.step = $step)
SELECT stage, rank, micro_batch, instr, (start_ns - min(start_ns) OVER ()) / 1e6 AS start_ms,
       duration_ns / 1e6 AS duration_ms
FROM p ORDER BY stage, start_ns
"""

_COLLECTIVES_SQL = """
WITH c AS (
    SELECT op, role, group_size, bytes, duration_ns,
           CAST(CASE WHEN bytes > 0 THEN pow(2, floor(log2(bytes))) ELSE 0 END AS BIGINT) AS size_bucket_bytes,
           bytes / nullif(duration_ns, 0) AS algbw_gbps,
           CASE WHEN op LIKE 'all_reduce%' THEN 2.0 * (group_size - 1) / group_size
                WHEN op LIKE '%all_gather%' OR op LIKE '%reduce_scatter%' OR op LIKE 'all_to_all%'
                     THEN 1.0 * (group_size - 1) / group_size
                ELSE 1.0 END AS bus_factor
    FROM collective WHERE run_id = $run AND step BETWEEN $coll_lo AND $step AND group_size > 0
)
SELECT op, role, size_bucket_bytes, count(*) AS calls, quantile_cont(bytes, 0.5) AS bytes_p50,
       quantile_cont(duration_ns, 0.5) / 1e6 AS duration_ms_p50,
       quantile_cont(duration_ns, 0.99) / 1e6 AS duration_ms_p99,
       quantile_cont(algbw_gbps, 0.5) AS algbw_gbps, quantile_cont(algbw_gbps * bus_factor, 0.5) AS busbw_gbps
FROM c GROUP BY op, role, size_bucket_bytes ORDER BY op, role, size_bucket_bytes
"""

_OFFLOAD_RATE_SQL = """
SELECT step, direction, CAST(sum(bytes) AS BIGINT) AS bytes, sum(bytes) / nullif(sum(duration_ns), 0) AS gbps
FROM offload WHERE run_id = $run AND step BETWEEN $lo AND $step GROUP BY step, direction ORDER BY step, direction
"""

_OFFLOAD_LAST_SQL = """
SELECT start_ns, rank, direction, what, bytes, duration_ns / 1e6 AS duration_ms
FROM offload WHERE run_id = $run AND step BETWEEN $lo AND $step ORDER BY start_ns DESC LIMIT 10
"""

_GPUS_SQL = """
SELECT node, gpu, arg_max(uuid, start_ns) AS uuid, arg_max(util_pct, start_ns) AS util_pct,
       arg_max(mem_used_bytes, start_ns) AS mem_used_bytes, arg_max(mem_total_bytes, start_ns) AS mem_total_bytes,
       arg_max(temp_c, start_ns) AS temp_c, arg_max(power_mw, start_ns) AS power_mw,
       arg_max(clock_event_reasons, start_ns) AS clock_event_reasons,
       arg_max(ecc_uncorrected, start_ns) AS ecc_uncorrected, max(start_ns) AS sampled_ns
FROM gpu_sample WHERE (run_id = $run OR node IN (SELECT hostname FROM run_start WHERE run_id = $run))
  AND start_ns BETWEEN $t_end_ns - $gpu_window_ns AND $t_end_ns
GROUP BY node, gpu ORDER BY node, gpu
"""

_XID_SQL = """
SELECT node, gpu, xid, description, start_ns FROM xid
WHERE (run_id = $run OR node IN (SELECT hostname FROM run_start WHERE run_id = $run)) AND start_ns BETWEEN $t_end_ns - $gpu_window_ns AND $t_end_ns ORDER BY start_ns DESC LIMIT 50
"""

# The comm_topology view (collector/query/dashboard.py) over the collectives section's steps.
_TOPOLOGY_SQL = ("SELECT * FROM (" + dashboard.comm_topology_sql("run_id = $run AND step BETWEEN $coll_lo AND $step")
                 + ') ORDER BY role, "group", op, src_node, dst_node')

# The hardware_risk view over the run's nodes' last RISK_WINDOW_S of agent samples (file replays
# only: a live watcher would re-read hours of samples per snapshot; see build()).
_GPU_RISK_SQL = dashboard.hardware_risk_sql(
    "$t_end_ns", "(run_id = $run OR node IN (SELECT hostname FROM run_start WHERE run_id = $run)) "
    "AND start_ns >= $t_end_ns - $risk_window_ns")

# The memory_fragmentation view over the window's steps (GPU ranks; NULL shares on CPU).
_FRAGMENTATION_SQL = ("SELECT rank, step, frag_bytes, frag_share, measured FROM ("
                      + dashboard.memory_fragmentation_sql("run_id = $run AND step BETWEEN $lo AND $step")
                      + ") ORDER BY rank, step")

SECTIONS: dict[str, str] = {
    "ranks": _RANKS_SQL,
    "steps": _STEPS_SQL,
    "bubble": _BUBBLE_SQL,
    "gantt": _GANTT_SQL,
    "collectives": _COLLECTIVES_SQL,
    "offload_rate": _OFFLOAD_RATE_SQL,
    "offload_last": _OFFLOAD_LAST_SQL,
    "gpus": _GPUS_SQL,
    "xids": _XID_SQL,
    "topology": _TOPOLOGY_SQL,
    "gpu_risk": _GPU_RISK_SQL,
    "fragmentation": _FRAGMENTATION_SQL,
}

#: Sections a watcher's snapshot (a cursor: live) leaves empty, with their reason.
REPLAY_ONLY = {"gpu_risk": "hours of agent samples per snapshot"}
#: Sections a watcher's snapshot leaves empty above this many ranks: the topology section's window
#: functions over every rank's collectives cost ~45 ms at 1,024 ranks and ~450 ms at 16,384 (5
#: steps x 4 collectives a rank, against ~225 ms for the collectives section; load 7, 2 cores).
LIVE_MAX_RANKS = {"topology": 1024}

#: The live engine's / controller's tables: read when present (newest first, bounded).
OPTIONAL_TABLES = ("alerts", "actions")

#: One rank over the window (the Ranks screen's drill-down).
RANK_DETAIL_SQL = """
WITH s AS (SELECT * FROM step WHERE run_id = $run AND rank = $rank AND step BETWEEN $lo AND $step),
c AS (SELECT step, sum(duration_ns) / 1e6 AS wait_ms, count(*) AS collectives FROM collective
      WHERE run_id = $run AND rank = $rank AND step BETWEEN $lo AND $step GROUP BY step),
m AS (SELECT step, arg_max(CASE WHEN allocated_bytes >= 0 THEN allocated_bytes ELSE rss_bytes END, start_ns) AS mem
      FROM memory WHERE run_id = $run AND rank = $rank AND step BETWEEN $lo AND $step GROUP BY step)
SELECT s.step, s.duration_ns / 1e6 AS step_ms, s.data_wait_ns / 1e6 AS data_wait_ms,
       s.forward_ns / 1e6 AS forward_ms, s.backward_ns / 1e6 AS backward_ms, s.optimizer_ns / 1e6 AS optimizer_ms,
       s.comm_exposed_ns / 1e6 AS comm_exposed_ms, s.compute_ns / 1e6 AS compute_ms, c.wait_ms, c.collectives,
       CAST(m.mem AS DOUBLE) AS mem_bytes
FROM s LEFT JOIN c ON c.step = s.step LEFT JOIN m ON m.step = s.step ORDER BY s.step
"""

RANK_COLLECTIVES_SQL = """
SELECT op, role, count(*) AS calls, CAST(sum(bytes) AS BIGINT) AS bytes, sum(duration_ns) / 1e6 AS total_ms,
       quantile_cont(duration_ns, 0.99) / 1e6 AS duration_ms_p99
FROM collective WHERE run_id = $run AND rank = $rank AND step BETWEEN $lo AND $step
GROUP BY op, role ORDER BY total_ms DESC
"""


def inline(sql: str, params: Mapping[str, Any]) -> str:
    """Substitute $name parameters with SQL literals (for Query.Sql, which takes text only).
    Values are ints, floats or strings; strings are quoted with '' doubled."""
    out = sql
    for name in sorted(params, key=len, reverse=True):
        v = params[name]
        if isinstance(v, str):
            lit = "'" + v.replace("'", "''") + "'"
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise SnapshotError(f"parameter ${name}: cannot inline {type(v).__name__}")
        else:
            lit = repr(int(v)) if isinstance(v, int) else repr(float(v))
        out = out.replace("$" + name, lit)
    return out


@dataclass
class Cursor:
    """What a watcher remembers between snapshots of one run, so that finding the newest step
    reads only the rows after the last one it saw."""

    run_id: str
    last_step: int = -1
    world: int = 0
    #: per-step aggregates (the `steps` section's rows) of complete steps, computed once each
    steps_cache: dict = field(default_factory=dict)
    steps_schema: Any = None
    #: STEP_BOUND sections: name -> (the live stamp they were built under, table)
    stamped: dict = field(default_factory=dict)
    #: the file's tables, once every OPTIONAL_TABLES is among them (tables are never dropped), and
    #: those tables' columns
    tables: set = field(default_factory=set)
    columns: dict = field(default_factory=dict)
    #: per step: the lost-time sums row then its most-charged ranks' rows (collector.query.lost_sql.lost_steps_sql)
    lost_cache: dict = field(default_factory=dict)


def latest_complete_step(run_sql: Callable[[str, list], list[tuple]], cur: Cursor) -> int:
    """The newest step every started rank has reported (or, if none is complete, the newest
    step minus one). Reads only step >= the cursor's last step."""
    lo = max(cur.last_step - 1, -1)
    rows = run_sql(
        "SELECT step, count(DISTINCT rank) FROM step WHERE run_id = ? AND step >= ? GROUP BY step ORDER BY step DESC",
        [cur.run_id, lo],
    )
    if not rows:
        return cur.last_step
    for step, n in rows:
        if n >= cur.world:
            cur.last_step = max(cur.last_step, int(step))
            return cur.last_step
    newest = int(rows[0][0])
    return max(cur.last_step, newest - 1 if newest > lo + 1 else int(rows[-1][0]))


class LiveSections(Protocol):
    """Where a collector's live state can stand in for some sections' SQL (collector/query/watch.py).
    Each method answers None when the live state does not hold what is asked (the SQL is used)."""

    #: the sections `sections` builds, when it answers
    provides: tuple[str, ...]

    def latest_step(self, run_id: str, world: int) -> int | None:
        """The newest step the live state holds from `world` ranks."""

    def sections(self, run_id: str, step: int, lo: int, gpus) -> dict | None:
        """The `provides` tables of steps lo..step, with the SQL's columns and types (`gpus`: the
        snapshot's gpus section, for the ranks' GPU util)."""

    def stamp(self, run_id: str, lo: int, step: int) -> tuple | None:
        """Changes whenever a row of steps lo..step comes in: a section of those steps only, built
        under the same stamp, is still true (None: unknown, build it)."""

    def lost(self, run_id: str):
        """The `lost` section from the live engine's lost-time gauges, with the SQL's columns
        (None: the engine has judged no step of the run)."""

    def judged(self, run_id: str) -> dict | None:
        """How much of the run the live judgments stand on: `steps_incomplete` (steps judged at the
        deadline without every rank), `last_incomplete_step`, `steps_skipped` (steps never judged, to
        keep up). None: the engine has judged no step of the run."""


#: Sections that read rows of the snapshot's steps only (no time window): live, a cursor keeps
#: them while the live state's stamp of those steps is unchanged (the collectives' quantiles cost
#: ~250 ms at 16,384 ranks; at 2 Hz most snapshots repeat the last complete step).
STEP_BOUND = ("gantt", "collectives", "offload_last")


def build(
    con,
    run_id: str,
    *,
    step: int | None = None,
    window_steps: int = DEFAULT_WINDOW_STEPS,
    cursor: Cursor | None = None,
    source: str = "",
    now_ns: int | None = None,
    live: LiveSections | None = None,
) -> Snapshot:
    """Build a snapshot of `run_id` at `step` (None: the latest complete step) from a DuckDB
    connection or cursor `con` (read-only use). Raises SnapshotError for an unknown run.

    live: a collector's live state, which builds the sections it `provides` instead of their SQL
    where it holds the steps (the header's `built_from` says which: "live" or "sql")."""
    import time

    runs = con.sql(RUN_SQL, params=[run_id]).to_arrow_table().to_pylist()
    if not runs:
        known = [r[0] for r in con.execute(RUNS_SQL).fetchall()]
        raise SnapshotError(
            f"run {run_id!r} is not in this file / collector; "
            + (f"runs here: {', '.join(known[-10:])}" if known else "no run has started here yet")
        )
    run = runs[0]
    cur = cursor or Cursor(run_id)
    cur.world = int(run["ranks_started"] or 0)
    first, last = con.execute("SELECT min(step), max(step) FROM step WHERE run_id = ? AND step >= ?",
                              [run_id, max(cur.last_step - 1, -1) if step is None else -1]).fetchall()[0]
    if step is None:
        held = live.latest_step(run_id, cur.world) if live is not None else None
        if held is not None and held >= cur.last_step:
            step = cur.last_step = held
        else:
            step = latest_complete_step(lambda q, p: con.execute(q, p).fetchall(), cur)
    if step is None or step < 0:
        step = -1
    lo = max(step - window_steps + 1, 0)
    t_end = con.execute(
        "SELECT max(start_ns + duration_ns) FROM step WHERE run_id = ? AND step = ?", [run_id, step]
    ).fetchall()[0][0]
    if t_end is None:
        t_end = now_ns if now_ns is not None else time.time_ns()
    params = {"run": run_id, "step": step, "lo": lo, "t_end_ns": int(t_end),
              "gpu_window_ns": int(GPU_WINDOW_S * 1e9), "risk_window_ns": int(RISK_WINDOW_S * 1e9)}
    params["coll_lo"] = max(step - COLLECTIVE_WINDOW_STEPS + 1, 0)
    tables = {}
    skip = set(live.provides) if live is not None and step >= 0 else set()
    for name, sql in SECTIONS.items():
        if name in skip:
            continue
        stamp = None
        if name in STEP_BOUND and cursor is not None and live is not None and step >= 0:
            stamp = (step, live.stamp(run_id, min(lo, params["coll_lo"]), step))
            kept = cursor.stamped.get(name)
            if stamp[1] is not None and kept is not None and kept[0] == stamp:
                tables[name] = kept[1]
                continue
        if name == "steps" and cursor is not None:
            tables[name] = _cached_steps(con, cursor, params)
            continue
        if cursor is not None and (name in REPLAY_ONLY or cur.world > LIVE_MAX_RANKS.get(name, cur.world)):
            tables[name] = con.sql(f"SELECT * FROM ({sql}) LIMIT 0",
                                   params={k: v for k, v in params.items() if "$" + k in sql}).to_arrow_table()
            continue
        used = {k: v for k, v in params.items() if "$" + k in sql}
        tables[name] = con.sql(sql, params=used).to_arrow_table()
        if stamp is not None and stamp[1] is not None:
            cursor.stamped[name] = (stamp, tables[name])  # type: ignore[union-attr]
    built_from = "sql"
    if skip:
        got = live.sections(run_id, step, lo, tables["gpus"])  # type: ignore[union-attr]
        if got is not None:
            built_from = "live"
            tables.update(got)
        else:  # the live state does not hold these steps: the SQL
            for name in skip:
                if name == "steps" and cursor is not None:
                    tables[name] = _cached_steps(con, cursor, params)
                    continue
                sql = SECTIONS[name]
                tables[name] = con.sql(sql, params={k: v for k, v in params.items() if "$" + k in sql}).to_arrow_table()
        tables = {name: tables[name] for name in SECTIONS}  # the wire order stays the SQL's
    # which optional tables (and columns) the file has: a watcher's cursor asks once they are all there
    present = cursor.tables if cursor is not None and cursor.tables else \
        {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    for name in OPTIONAL_TABLES:
        if name in present:
            cols = cursor.columns.get(name) if cursor is not None else None
            if cols is None:
                cols = {r[0] for r in con.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [name]).fetchall()}
                if cursor is not None:
                    cursor.columns[name] = cols
            where = "WHERE run_id = ?" if "run_id" in cols else ""
            args = [run_id] if where else []
            order = next((f"ORDER BY {c} DESC" for c in ("last_ns", "updated_ns", "proposed_ns", "first_ns", "start_ns")
                          if c in cols), "")
            tables[name] = con.sql(f"SELECT * FROM {name} {where} {order} LIMIT 200", params=args).to_arrow_table()
    if cursor is not None and not cursor.tables and all(n in present for n in OPTIONAL_TABLES):
        cursor.tables = set(present)
    lost_window_s = LOST_WINDOW_S
    if "step_ranks" in present and step >= 0:
        # live: the engine's own lost-time gauges over its window (collector/live/lost.py, the same
        # definition as the view), not ~0.6 s of SQL per new step at 16,384 ranks
        got = live.lost(run_id) if live is not None else None
        if got is not None:
            tables["lost"], lost_window_s = got
        else:
            tables["lost"] = _lost(con, cursor, run_id, step, int(t_end))
    first_step = con.execute("SELECT min(step) FROM step WHERE run_id = ? AND step BETWEEN 0 AND ?",
                             [run_id, max(window_steps, 1)]).fetchall()[0][0]
    offload = ""
    try:
        cfg = json.loads(run.get("ds_config_json") or "{}")
        zo = cfg.get("zero_optimization", {}) or {}
        offload = ",".join(
            f"{k.split('_')[1]}:{(zo.get(k) or {}).get('device', 'none')}"
            for k in ("offload_optimizer", "offload_param") if (zo.get(k) or {}).get("device", "none") != "none"
        )
    except (ValueError, AttributeError):
        offload = ""
    header = {
        "run_id": run_id,
        "source": source,
        "step": int(step),
        "window_lo": int(lo),
        "first_step": int(first_step if first_step is not None else (first if first is not None else -1)),
        "last_step": int(last if last is not None else step),
        "step_end_ns": int(t_end),
        "collectives_lo": int(params["coll_lo"]),
        "taken_ns": time.time_ns(),
        "world_size": int(run["world_size"] or 0),
        "ranks_started": int(run["ranks_started"] or 0),
        "nodes": int(run["nodes"] or 0),
        "tp": int(run["tp"] or 1), "pp": int(run["pp"] or 1), "dp": int(run["dp"] or 1),
        "zero_stage": int(run["zero_stage"] if run["zero_stage"] is not None else -1),
        "model_name": run["model_name"] or "",
        "n_params": int(run["n_params"] or 0),
        "micro_batch": int(run["micro_batch"] or 0),
        "micro_batches": int(run["micro_batches"] or 0),
        "offload": offload or "none",
        "has_alerts": "alerts" in present,
        "has_actions": "actions" in present,
        "built_from": built_from,
        "lost_window_s": lost_window_s,
    }
    judged = live.judged(run_id) if live is not None else None
    if judged:
        header["live_judged"] = judged
    return Snapshot(header, tables)


def _lost(con, cursor: Cursor | None, run_id: str, step: int, t_end_ns: int):
    """The lost section. Live (a cursor): each step's sums and its 16 most-charged ranks are read
    once and kept, so a snapshot reads only the steps completed since the last (one step of 16,384
    ranks costs ~0.6 s of SQL on the loaded 2-core machine, collector/bench/watch_snapshot.py); the
    ranks' shares are then over those 16 per step. A file (no cursor): the last DEFAULT_WINDOW_STEPS
    steps, every rank."""
    import pyarrow as pa

    from collector.query.lost_sql import lost_steps_sql, lost_window_sql

    since = t_end_ns - int(LOST_WINDOW_S * 1e9)
    if cursor is None:
        return con.sql(lost_window_sql(), params={"run": run_id, "lo": max(step - DEFAULT_WINDOW_STEPS + 1, 0),
                                                  "hi": step, "since_ns": since}).to_arrow_table()
    cache = cursor.lost_cache
    lo = max(step - LOST_WINDOW_STEPS + 1, 0)
    # the steps after the newest one read (at most a section's window at once: the window fills as
    # the watcher runs); a live snapshot's step is complete, so a step read once is not read again
    newest = max((s for s in cache if s <= step), default=None)
    todo = max(step - (DEFAULT_WINDOW_STEPS if newest is not None else LOST_FIRST_STEPS) + 1, lo,
               newest + 1 if newest is not None else 0)
    if todo <= step:
        rows = con.sql(lost_steps_sql(), params={"run": run_id, "lo": todo, "hi": step}).fetchall()
        for s in range(todo, step + 1):
            cache[s] = [r for r in rows if r[0] == s]
    for s in [s for s in cache if s < lo or s > step]:
        del cache[s]
    keys = ("straggler_gpu_ms", "data_gpu_ms", "pipeline_gpu_ms", "comm_gpu_ms", "lost_gpu_ms")
    total = dict.fromkeys(keys, 0.0)
    ranks: dict[int, list[float]] = {}
    ends = []
    for s in sorted(cache):
        rows = cache[s]
        if not rows:
            continue
        head = rows[0]
        if head[7] is None or head[7] < since:
            continue
        ends.append(int(head[7]))
        for i, k in enumerate(keys):
            total[k] += head[2 + i] or 0.0
        for r in rows[1:]:
            acc = ranks.setdefault(int(r[1]), [0.0] * 5)
            for i in range(5):
                acc[i] += r[2 + i] or 0.0
    out = [{"rank": None, **total, "steps": len(ends), "first_end_ns": min(ends) if ends else None,
            "last_end_ns": max(ends) if ends else None}]
    for r in sorted(ranks, key=lambda r: (-ranks[r][4], r))[:5]:
        out.append({"rank": r, **dict(zip(keys, ranks[r], strict=True)), "steps": len(ends),
                    "first_end_ns": min(ends) if ends else None, "last_end_ns": max(ends) if ends else None})
    return pa.Table.from_pylist(out, schema=lost_schema())


def lost_schema():
    """The `lost` section's columns (the SQL-built and the live-built alike)."""
    import pyarrow as pa

    return pa.schema([("rank", pa.int32()), *[(k, pa.float64()) for k in LOST_KEYS],
                      ("steps", pa.int64()), ("first_end_ns", pa.int64()), ("last_end_ns", pa.int64())])


LOST_KEYS = ("straggler_gpu_ms", "data_gpu_ms", "pipeline_gpu_ms", "comm_gpu_ms", "lost_gpu_ms")


def _cached_steps(con, cursor: Cursor, params: dict):
    """The steps section live: steps at or below the latest complete step do not change, so each
    is aggregated once (at 16,384 ranks the whole window cost ~360 ms a snapshot, one step ~1/30)."""
    import pyarrow as pa

    step, lo = params["step"], params["lo"]
    # the snapshot's own step is always recomputed (it may be the newest-but-one of an incomplete run)
    todo_lo = min(max([lo] + [s + 1 for s in cursor.steps_cache if s <= step]), step)
    if todo_lo <= step:
        p = dict(params, lo=todo_lo)
        used = {k: v for k, v in p.items() if "$" + k in _STEPS_SQL}
        fresh = con.sql(_STEPS_SQL, params=used).to_arrow_table()
        for row in fresh.to_pylist():
            cursor.steps_cache[int(row["step"])] = row
        cursor.steps_schema = fresh.schema
    for s in [s for s in cursor.steps_cache if s < lo]:
        del cursor.steps_cache[s]
    rows = [cursor.steps_cache[s] for s in sorted(cursor.steps_cache) if lo <= s <= step]
    if cursor.steps_schema is None:
        return pa.Table.from_pylist(rows)
    return pa.Table.from_pylist(rows, schema=cursor.steps_schema)


def rank_detail(con, run_id: str, rank: int, step: int, window_steps: int = DEFAULT_WINDOW_STEPS) -> dict:
    """One rank over the window: {"steps": table, "collectives": table}."""
    params = {"run": run_id, "rank": int(rank), "step": int(step), "lo": max(int(step) - window_steps + 1, 0)}
    return {
        "steps": con.sql(RANK_DETAIL_SQL, params=params).to_arrow_table(),
        "collectives": con.sql(RANK_COLLECTIVES_SQL, params=params).to_arrow_table(),
    }
