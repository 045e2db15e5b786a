"""`tracetop export FILE --perfetto OUT.json [--parquet DIR] [--run RUN]`: the file in other tools' formats.

**Perfetto / chrome://tracing** (Chrome trace-event JSON, `{"traceEvents": [...]}`): one process
per node (pid, named by hostname), one thread per rank (tid = rank * 10 + 1, named "rank R (stage
S)") carrying its steps and pipeline instructions, with sibling threads "rank R collectives" (tid
+ 1) and "rank R offload" (tid + 2, only where copies exist): collectives may run async and
overlap the instructions, and trace-event slices on one thread must nest. Each step slice carries
its phases (data wait, forward, backward, optimizer, exposed communication, compute) as args, and
the same figures are drawn as a counter track per rank ("rank R phase ms"). Timestamps are
microseconds since the first event; each rank's clock is moved by its node's `clock_offset`
(median `offset_ns`, collector clock minus node clock) where the file has one.

Profiling windows (`tracetop profile`; table `profile_traces`): each stored trace's events go
beside the rank's own tracks, on threads "rank R profiler ..." (tid = rank * 10 + 4 onward, one
per thread the profiler saw, at most six), with a slice "profiling window" over the window. Same
clock base: the profiler writes `ts` in microseconds after its `baseTimeNanoseconds` (the node's
wall clock, as tracetop's own rows), so an event lands at base + ts, moved by the node's offset
like the rank's steps. Only complete and instant events are kept (no flow arrows, no metadata).

**Parquet** (`--parquet DIR`): one dataset per table, hive-partitioned by run
(`DIR/step/run_id=R/part-0.parquet`; tables without a run column unpartitioned). Written into a
temporary sibling folder that is renamed to DIR at the end, so an error leaves nothing behind.
Read back with DuckDB: `SELECT * FROM read_parquet('DIR/step/**/*.parquet', hive_partitioning=true)`.
Both paths read the file through a connection with external access off; the writing is done by
Python (json, pyarrow), never by SQL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from collector.query.post_file import PostFileError, has_relation, pick_run

TID_PROFILER = 4  # rank * 10 + 4 .. + 9: the profiler's threads
MAX_PROFILER_TRACKS = 6
PHASES = ("data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns", "comm_exposed_ns", "compute_ns")
TID_MAIN, TID_COMM, TID_OFFLOAD = 1, 2, 3


class ExportError(PostFileError):
    """Cannot export: the message says why and what to do."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a collector's DuckDB file (no collector holding it)")
    parser.add_argument("--perfetto", type=Path, default=None, metavar="OUT.json",
                        help="write Chrome trace-event JSON (open in ui.perfetto.dev or chrome://tracing)")
    parser.add_argument("--parquet", type=Path, default=None, metavar="DIR",
                        help="write one Parquet dataset per table, partitioned by run (DIR must not exist)")
    parser.add_argument("--run", default=None, help="only this run (default: every run; Perfetto: the latest)")
    parser.add_argument("--steps", type=_step_range, default=None, metavar="FROM:TO",
                        help="Perfetto: only steps FROM..TO (inclusive), for long runs")


def _step_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: give FROM:TO, e.g. 100:120") from e
    if lo > hi:
        raise argparse.ArgumentTypeError(f"{text!r}: FROM is after TO")
    return lo, hi


def run(args: argparse.Namespace) -> int:
    from collector.query.post_file import open_read_only

    if args.perfetto is None and args.parquet is None:
        print("tracetop export: say what to write: --perfetto OUT.json and/or --parquet DIR", file=sys.stderr)
        return 2
    try:
        con = open_read_only(args.file)
    except PostFileError as e:
        print(f"tracetop export: {e}", file=sys.stderr)
        return 2
    try:
        if args.parquet is not None:
            n = export_parquet(con, args.parquet, args.run)
            print(f"tracetop export: {n} tables to {args.parquet}/")
        if args.perfetto is not None:
            counts = export_perfetto(con, args.perfetto, args.run, args.steps)
            total = sum(counts.values())
            print(f"tracetop export: {total} trace events to {args.perfetto} "
                  f"({', '.join(f'{k} {v}' for k, v in counts.items())}); open it in https://ui.perfetto.dev")
    except PostFileError as e:
        print(f"tracetop export: {e}", file=sys.stderr)
        return 2
    finally:
        con.close()
    return 0


# ----------------------------------------------------------------------------- Perfetto



def rank_layout(con, run_id: str) -> dict[int, tuple[str, int, int]]:
    """rank -> (hostname, stage, clock offset ns). Ranks without a run_start row go to node '?'."""
    offsets: dict[str, int] = {}
    if has_relation(con, "clock_offset"):
        offsets = {n: int(o) for n, o in con.execute(
            "SELECT node, median(offset_ns) FROM clock_offset GROUP BY node").fetchall()}
    starts = {r: (h or "?", s if s is not None else -1) for r, h, s in con.execute(
        "SELECT rank, any_value(hostname), any_value(stage) FROM run_start WHERE run_id = ? GROUP BY rank",
        [run_id]).fetchall()}
    ranks = [r for (r,) in con.execute("SELECT DISTINCT rank FROM step WHERE run_id = ?", [run_id]).fetchall()]
    out = {}
    for r in sorted(set(ranks) | set(starts)):
        host, stage = starts.get(r, ("?", -1))
        out[r] = (host, stage, offsets.get(host, 0))
    return out


def metadata_events(layout: dict[int, tuple[str, int, int]], has_offload: set[int]) -> list[dict]:
    """process_name per node, thread_name / sort index per rank track."""
    hosts = sorted({h for h, _, _ in layout.values()})
    pid = {h: i + 1 for i, h in enumerate(hosts)}
    ev: list[dict] = []
    for h in hosts:
        ev.append({"ph": "M", "name": "process_name", "pid": pid[h], "tid": 0, "args": {"name": f"node {h}"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": pid[h], "tid": 0, "args": {"sort_index": pid[h]}})
    for r, (h, stage, _) in layout.items():
        base = r * 10
        label = f"rank {r}" + (f" (stage {stage})" if stage >= 0 else "")
        tracks = [(TID_MAIN, label), (TID_COMM, f"rank {r} collectives")]
        if r in has_offload:
            tracks.append((TID_OFFLOAD, f"rank {r} offload"))
        for k, name in tracks:
            ev.append({"ph": "M", "name": "thread_name", "pid": pid[h], "tid": base + k, "args": {"name": name}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid[h], "tid": base + k,
                       "args": {"sort_index": base + k}})
    return ev


def export_perfetto(con, out: Path, run: str | None = None, steps: tuple[int, int] | None = None) -> dict[str, int]:
    """Write the run's timeline (steps lo..hi inclusive, or all) to `out` (via a temp file renamed
    at the end); return event counts by category."""
    run_id = pick_run(con, run)
    cond = "run_id = ?" + (" AND step BETWEEN ? AND ?" if steps else "")
    params = [run_id, *(steps or ())]
    layout = rank_layout(con, run_id)
    hosts = sorted({h for h, _, _ in layout.values()})
    pid = {h: i + 1 for i, h in enumerate(hosts)}
    t0 = con.execute(f"SELECT min(start_ns) FROM step WHERE {cond}", params).fetchone()[0]
    if t0 is None:
        raise ExportError(f"run {run_id} has no steps in {steps[0]}..{steps[1]}")
    for table in ("pipe_instr", "collective", "offload"):
        t = con.execute(f"SELECT min(start_ns) FROM {table} WHERE {cond}", params).fetchone()[0]
        if t is not None:
            t0 = min(t0, t)

    def place(rank: int, start_ns: int, k: int) -> tuple[int, int, float]:
        host, _, off = layout.get(rank, ("?", -1, 0))
        return pid.get(host, 0), rank * 10 + k, round((start_ns + off - t0) / 1e3, 3)

    has_offload = {r for (r,) in con.execute(f"SELECT DISTINCT rank FROM offload WHERE {cond}",
                                             params).fetchall()}
    counts = {"step": 0, "pipe": 0, "collective": 0, "offload": 0, "counter": 0, "profiler": 0}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write('{"displayTimeUnit": "ms", "otherData": ')
            json.dump({"run_id": run_id, "t0_ns": int(t0), "steps": list(steps) if steps else None,
                       "source": "tracetop export"}, f)
            f.write(', "traceEvents": [\n')
            first = True

            def emit(e: dict) -> None:
                nonlocal first
                if not first:
                    f.write(",\n")
                first = False
                f.write(json.dumps(e, separators=(",", ":")))

            for e in metadata_events(layout, has_offload):
                emit(e)
            cols = ", ".join(PHASES)
            for row in _rows(con, f"SELECT rank, step, start_ns, duration_ns, {cols}, loss FROM step "
                                  f"WHERE {cond} ORDER BY rank, start_ns", params):
                rank, step, start, dur = row[:4]
                p, t, ts = place(rank, start, TID_MAIN)
                phases = {k[:-3] + "_ms": (v / 1e6 if v is not None else None) for k, v in zip(PHASES, row[4:10])}
                args = {"step": step, **phases}
                if row[10] is not None:
                    args["loss"] = row[10]
                emit({"ph": "X", "cat": "step", "name": f"step {step}", "pid": p, "tid": t, "ts": ts,
                      "dur": round(dur / 1e3, 3), "args": args})
                counts["step"] += 1
                emit({"ph": "C", "name": f"rank {rank} phase ms", "pid": p, "ts": ts,
                      "args": {k: v for k, v in phases.items() if v is not None and k != "compute_ms"}})
                counts["counter"] += 1
            for rank, step, start, dur, stage, mb, instr in _rows(
                    con, "SELECT rank, step, start_ns, duration_ns, stage, micro_batch, instr FROM pipe_instr "
                         f"WHERE {cond} ORDER BY rank, start_ns", params):
                p, t, ts = place(rank, start, TID_MAIN)
                emit({"ph": "X", "cat": "pipe", "name": instr, "pid": p, "tid": t, "ts": ts,
                      "dur": round(dur / 1e3, 3), "args": {"step": step, "stage": stage, "micro_batch": mb}})
                counts["pipe"] += 1
            for rank, step, start, dur, op, role, gs, nbytes, peer, is_async in _rows(
                    con, "SELECT rank, step, start_ns, duration_ns, op, role, group_size, bytes, peer, is_async "
                         f"FROM collective WHERE {cond} ORDER BY rank, start_ns", params):
                p, t, ts = place(rank, start, TID_COMM)
                args = {"step": step, "role": role, "group_size": gs, "bytes": nbytes, "async": bool(is_async)}
                if peer is not None and peer >= 0:
                    args["peer"] = peer
                emit({"ph": "X", "cat": "collective", "name": f"{op} [{role}]", "pid": p, "tid": t, "ts": ts,
                      "dur": round(dur / 1e3, 3), "args": args})
                counts["collective"] += 1
            for rank, step, start, dur, direction, what, nbytes in _rows(
                    con, "SELECT rank, step, start_ns, duration_ns, direction, what, bytes FROM offload "
                         f"WHERE {cond} ORDER BY rank, start_ns", params):
                p, t, ts = place(rank, start, TID_OFFLOAD)
                gbps = nbytes / dur if dur else None
                emit({"ph": "X", "cat": "offload", "name": f"{direction} {what}", "pid": p, "tid": t, "ts": ts,
                      "dur": round(dur / 1e3, 3), "args": {"step": step, "bytes": nbytes, "gbps": gbps}})
                counts["offload"] += 1
            for e in profiler_events(con, run_id, steps, place):
                emit(e)
                counts["profiler"] += 1
            f.write("\n]}\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return counts


def profiler_events(con, run_id: str, steps: tuple[int, int] | None, place) -> list[dict]:
    """The stored profiling windows' events (those whose steps meet ``steps``), placed on the
    rank's profiler tracks by ``place(rank, wall_ns, k)`` (see the module doc)."""
    from collector.control import profiles

    out: list[dict] = []
    for w in profiles.traces(con, run_id):
        if w["state"] != "stored":
            continue
        first, last = int(w["first_step"]), int(w["first_step"]) + max(1, int(w["steps"] or 0)) - 1
        if steps and (last < steps[0] or first > steps[1]):
            continue
        rank = int(w["rank"])
        trace = profiles.trace_json(con, run_id, w["action_id"], rank)
        threads: dict[tuple, int] = {}
        pid, tid0, ts = place(rank, int(w["start_ns"]), TID_PROFILER)
        _, _, ts_end = place(rank, int(w["end_ns"]), TID_PROFILER)
        out.append({"ph": "X", "cat": "profiler", "name": f"profiling window (action {w['action_id']})",
                    "pid": pid, "tid": tid0, "ts": ts, "dur": round(ts_end - ts, 3),
                    "args": {"first_step": first, "steps": w["steps"], "action_id": w["action_id"]}})
        names: dict[int, str] = {tid0: f"rank {rank} profiler"}
        for e in trace.get("traceEvents", ()):
            ph = e.get("ph")
            if ph not in ("X", "i", "I") or "ts" not in e:
                continue
            key = (e.get("pid"), e.get("tid"))
            k = threads.get(key)
            if k is None:
                k = threads[key] = min(len(threads), MAX_PROFILER_TRACKS - 1)
                names.setdefault(tid0 + k, f"rank {rank} profiler {e.get('pid')}/{e.get('tid')}")
            p, t, at = place(rank, profiles.wall_ns(trace, e["ts"]), TID_PROFILER + k)
            ev = {"ph": ph, "cat": "profiler" + (f":{e['cat']}" if e.get("cat") else ""), "name": e.get("name", "?"),
                  "pid": p, "tid": t, "ts": at, "args": dict(e.get("args") or {}, rank=rank)}
            if ph == "X":
                ev["dur"] = e.get("dur", 0)
            else:
                ev["s"] = "t"
            out.append(ev)
        for t, name in names.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t, "args": {"sort_index": t}})
    return out


def _rows(con, sql: str, params: list, chunk: int = 50_000):
    cur = con.cursor()
    try:
        cur.execute(sql, params)
        while True:
            rows = cur.fetchmany(chunk)
            if not rows:
                break
            yield from rows
    finally:
        cur.close()


# ----------------------------------------------------------------------------- Parquet


def export_parquet(con, out_dir: Path, run: str | None = None) -> int:
    """One dataset per table under `out_dir`, hive-partitioned by run_id. Returns the table count."""
    import pyarrow.dataset as ds

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty folder; remove it or name another")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".tmp", dir=out_dir.parent))
    try:
        tables = [t for (t,) in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' ORDER BY 1").fetchall()]
        for t in tables:
            has_run = bool(con.execute(
                "SELECT count(*) FROM duckdb_columns() WHERE table_name = ? AND column_name = 'run_id'", [t]
            ).fetchone()[0])
            where, params = ("WHERE run_id = ?", [run]) if (run is not None and has_run) else ("", [])
            cur = con.cursor()
            try:
                reader = cur.sql(f'SELECT * FROM "{t}" {where}', params=params).to_arrow_reader(100_000)
                (tmp / t).mkdir()
                if has_run:
                    ds.write_dataset(reader, tmp / t, format="parquet", partitioning=["run_id"],
                                     partitioning_flavor="hive", basename_template="part-{i}.parquet",
                                     existing_data_behavior="overwrite_or_ignore")
                else:
                    ds.write_dataset(reader, tmp / t, format="parquet", basename_template="part-{i}.parquet",
                                     existing_data_behavior="overwrite_or_ignore")
            finally:
                cur.close()
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(tables)
