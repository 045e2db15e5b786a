"""A run's verdict: what bounds it, the evidence in numbers, and the next thing to try.

Three layers, as in `report.py`: `gather(con, run_id)` runs aggregate SQL over a collector's file
and returns a plain `RunFacts`; `judge(facts)` is a pure function to a `Verdict`; `render(verdict)`
is the paragraph. `tracetop summary`, the top of `tracetop report`, the TUI overview and the end of
`make demo` all print `render(judge(gather(...)))`.

How the bound is chosen (the judgment reads what the run *lost*, the `lost_time` view's split of
GPU time, collector/query/lost_sql.py, against the GPU time it held):

| bound | when | next |
|---|---|---|
| straggler | straggler share of the held GPU time >= BOUND_SHARE; the rank charged most is named | the rank's node: drain it, or check its clocks |
| input straggler | data share >= BOUND_SHARE, one rank charged >= ONE_RANK_SHARE of it | that rank's input pipeline |
| input-bound | data share >= BOUND_SHARE, spread over the ranks | more DataLoader workers, prefetch, pinned memory |
| pipeline bubble | pipeline share >= BOUND_SHARE | more micro-batches |
| exposed communication | comm share >= BOUND_SHARE | larger DDP buckets, overlap |
| memory | nothing above, and a rank's memory grew >= MEMORY_CREEP of its first reading (and 64 MiB) | find what is held across steps |
| compute | none of the above | the model's own step: larger micro-batch, mixed precision |

The largest share over BOUND_SHARE wins; the others over it are named as well. Fault incidents the
live engine raised (the `alerts` table; consequences are told under their cause) are listed under
it, one line each, as they were named, each with its next step (INCIDENT_NEXT).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from collector.query.post_file import has_relation

#: a cause bounds the run when it lost at least this share of the GPU time the run held
BOUND_SHARE = 0.15
#: a cause is one rank's when that rank is charged at least this share of it
ONE_RANK_SHARE = 0.6
#: memory creep: the last reading at least this much above the first (and at least MEMORY_CREEP_MIN_BYTES)
MEMORY_CREEP = 0.2
MEMORY_CREEP_MIN_BYTES = 64 * 2**20
CAUSES = ("straggler", "data", "pipeline", "comm")


#: an incident's next step, by the signal that opened it (the live engine's fault signals)
INCIDENT_NEXT = {
    "straggler": "look at that rank's node (clocks, temperature, neighbours); drain it if it stays slow",
    "data_stall": "that rank's input pipeline: more DataLoader workers, prefetch, its node's disk and CPU",
    "memory": "a smaller micro-batch (the controller can apply one: tracetop control set-micro-batch), "
              "activation checkpointing, or a larger budget",
    "silent_rank": "that rank's log and node (OOM killer, a hung process: py-spy dump)",
    "first_failure": "that rank's log first: the others failed after it, waiting in collectives",
    "unheard_rank": "that rank never shipped: its TRACETOP_ENDPOINT, its launch, its log",
    "stuck_collective": "py-spy dump the ranks not in the collective: one of them is elsewhere",
    "loss_spike": "the batch of that step (data), then the learning rate and gradient clipping",
}


@dataclass(frozen=True)
class RunFacts:
    """What the verdict reads, all in ms (medians over step rows after the first step) or GPU-ms."""

    run_id: str
    ranks: int
    steps: int
    step_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    comm_ms: float
    held_gpu_ms: float                        # sum over steps of the step's median time x GPUs
    lost_gpu_ms: dict[str, float]             # per cause (CAUSES)
    #: cause -> (rank, node, its GPU-ms, steps it was charged, on those steps: median compute beyond its
    #: stage's other ranks in ms, median data wait in ms): the rank charged the most
    top_rank: dict[str, tuple]
    rank_data_ms: dict[int, float]            # per rank: median data wait
    rank_compute_ms: dict[int, float]         # per rank: median compute
    bubble: list[tuple] = field(default_factory=list)    # (stage, measured, ideal)
    memory_growth: tuple | None = None        # (rank, first bytes, last bytes) of the rank that grew most
    incidents: list[tuple] = field(default_factory=list)  # (signal, rank, first_step, message)


@dataclass(frozen=True)
class Verdict:
    run_id: str
    bound: str           # straggler | input straggler | input-bound | pipeline bubble | exposed communication | memory | compute | no steps
    why: str             # the evidence, in numbers
    next: str            # the next thing to try
    also: list[str]      # other causes over BOUND_SHARE, one phrase each
    shares: dict[str, float]
    incidents: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- gathering (SQL)

PHASES_SQL = """
SELECT count(DISTINCT rank), count(DISTINCT step), median(duration_ns) / 1e6, median(data_wait_ns) / 1e6,
       median(forward_ns) / 1e6, median(backward_ns) / 1e6, median(optimizer_ns) / 1e6, median(comm_exposed_ns) / 1e6
FROM step WHERE run_id = ? AND step >= ?
"""

RANKS_SQL = """
SELECT rank, median(data_wait_ns) / 1e6, median(compute_ns) / 1e6 FROM step
WHERE run_id = ? AND step >= ? GROUP BY rank ORDER BY rank
"""




def _columns(con, table: str) -> set[str]:
    return {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [table]).fetchall()}


def gather(con, run_id: str, comm_baseline_share: float = 0.30) -> RunFacts:
    """The run's facts from a collector's DuckDB file (read-only connection; temp tables only)."""
    from collector.query.lost_sql import lost_time_sql

    first = con.execute("SELECT coalesce(min(step), 0) FROM step WHERE run_id = ?", [run_id]).fetchone()[0]
    since = first + 1  # the first step: warm-up
    ph = con.execute(PHASES_SQL, [run_id, since]).fetchone()
    ranks, steps = int(ph[0] or 0), int(ph[1] or 0)
    vals = [float(v or 0.0) for v in ph[2:]]
    lost = dict.fromkeys(CAUSES, 0.0)
    top: dict[str, tuple] = {}
    held = 0.0
    if steps and has_relation(con, "step_ranks"):
        params = {"run": run_id, "lo": since, "hi": 2**62}
        con.execute(f"CREATE OR REPLACE TEMP TABLE _verdict_lost AS "
                    f"{lost_time_sql(comm_baseline_share=comm_baseline_share, bounded=True)}", params)
        try:
            sums = ", ".join(f"coalesce(sum({c}_gpu_ms), 0)" for c in CAUSES)
            row = con.execute(f"SELECT {sums} FROM _verdict_lost").fetchone()
            lost = {c: float(row[i]) for i, c in enumerate(CAUSES)}
            held = float(con.execute("SELECT coalesce(sum(g), 0) FROM (SELECT any_value(step_ms_p50) * any_value(gpus) "
                                     "AS g FROM _verdict_lost GROUP BY step)").fetchone()[0])
            for c in CAUSES:
                r = con.execute(f"SELECT rank, any_value(node), sum({c}_gpu_ms) AS l, "
                                f"count(*) FILTER (WHERE {c}_gpu_ms > 0), "
                                f"median(excess_ms) FILTER (WHERE {c}_gpu_ms > 0), "
                                f"median(data_wait_ms) FILTER (WHERE {c}_gpu_ms > 0) "
                                f"FROM _verdict_lost GROUP BY rank ORDER BY l DESC, rank LIMIT 1").fetchone()
                if r is not None:
                    top[c] = (int(r[0]), r[1], float(r[2] or 0.0), int(r[3] or 0), float(r[4] or 0.0),
                              float(r[5] or 0.0))
        finally:
            con.execute("DROP TABLE IF EXISTS temp._verdict_lost")
    per_rank = con.execute(RANKS_SQL, [run_id, since]).fetchall()
    bubble: list[tuple] = []
    if has_relation(con, "bubble_by_stage"):
        bubble = [tuple(r) for r in con.execute(
            "SELECT stage, avg(bubble_rate), any_value(ideal_bubble_rate) FROM bubble_by_stage WHERE run_id = ? "
            "AND step >= ? GROUP BY stage ORDER BY stage", [run_id, since]).fetchall()]
    growth = None
    if has_relation(con, "memory"):
        g = con.execute(
            "SELECT rank, arg_min(b, start_ns), arg_max(b, start_ns) FROM (SELECT rank, start_ns, "
            "CASE WHEN allocated_bytes > 0 THEN allocated_bytes ELSE rss_bytes END AS b FROM memory "
            "WHERE run_id = ? AND b > 0) GROUP BY rank ORDER BY arg_max(b, start_ns) - arg_min(b, start_ns) DESC "
            "LIMIT 1", [run_id]).fetchone()
        if g is not None:
            growth = (int(g[0]), int(g[1]), int(g[2]))
    incidents: list[tuple] = []
    if has_relation(con, "alerts"):
        cols = _columns(con, "alerts")
        has_kind = "kind" in cols
        # a consequence (its incident_id another alert's) is told under its cause, not as an incident
        own = "AND (incident_id IS NULL OR incident_id = id)" if {"incident_id", "id"} <= cols else ""
        rows = con.execute(f"SELECT signal, rank, first_step, message, {'kind' if has_kind else 'NULL'} FROM alerts "
                           f"WHERE run_id = ? AND fired_ns > 0 {own} ORDER BY fired_ns", [run_id]).fetchall()
        if not has_kind and rows:  # a file from before alert kinds: the signal's default kind
            from collector.live.rules import DEFAULT_KIND

            rows = [(*r[:4], DEFAULT_KIND.get(r[0], "fault")) for r in rows]
        incidents = [tuple(r[:4]) for r in rows if r[4] == "fault"]
    return RunFacts(run_id, ranks, steps, *vals, held_gpu_ms=held, lost_gpu_ms=lost, top_rank=top,
                    rank_data_ms={int(r[0]): float(r[1] or 0.0) for r in per_rank},
                    rank_compute_ms={int(r[0]): float(r[2] or 0.0) for r in per_rank},
                    bubble=bubble, memory_growth=growth, incidents=incidents)


# ----------------------------------------------------------------------------- judging (pure)


def _others_median(values: dict[int, float], leave_out: int) -> float:
    rest = sorted(v for k, v in values.items() if k != leave_out)
    if not rest:
        return 0.0
    n = len(rest)
    return rest[n // 2] if n % 2 else (rest[n // 2 - 1] + rest[n // 2]) / 2


def _where(rank: int, node) -> str:
    return f"rank {rank}" + (f" (node {node})" if node else "")


def judge(f: RunFacts) -> Verdict:
    """The bound of the run, its evidence and the next step (module docstring's table)."""
    incidents = [f"{sig}" + (f" on rank {rank}" if rank is not None else "") + f" from step {fs}: {msg}"
                 + (f"; next: {INCIDENT_NEXT[sig]}" if sig in INCIDENT_NEXT else "")
                 for sig, rank, fs, msg in f.incidents]
    if not f.steps:
        return Verdict(f.run_id, "no steps", "the file has no step rows after the first for this run",
                       "instrument the loop (trainer_hooks.auto(model, optimizer)) and run it for a few steps",
                       [], {}, incidents)
    held = f.held_gpu_ms or 1.0
    shares = {c: f.lost_gpu_ms.get(c, 0.0) / held for c in CAUSES}
    over = sorted((c for c in CAUSES if shares[c] >= BOUND_SHARE), key=lambda c: -shares[c])
    step = f"{f.step_ms:.1f} ms step"
    phases = (f"data {f.data_ms:.1f}, forward {f.forward_ms:.1f}, backward {f.backward_ms:.1f}, "
              f"optimizer {f.optimizer_ms:.1f}, exposed communication {f.comm_ms:.1f} ms")

    def one_rank(c: str) -> tuple | None:
        t = f.top_rank.get(c)
        lost = f.lost_gpu_ms.get(c, 0.0)
        return t if t and lost > 0 and t[2] / lost >= ONE_RANK_SHARE else None

    def explain(c: str) -> tuple[str, str, str]:
        pct = f"{shares[c]:.0%} of the GPU time the run held"
        if c == "straggler":
            t = f.top_rank.get(c) or (-1, None, 0.0, 0, 0.0, 0.0)
            r = t[0]
            return ("straggler",
                    f"{_where(r, t[1])} computes {t[4]:.1f} ms a step longer than its peers (median) on the {t[3]} "
                    f"of {f.steps} steps it paced, and they wait for it: {pct} lost ({step}: {phases})",
                    f"look at {_where(r, t[1])}: its clocks, temperature and neighbours (`tracetop ui`, Ranks); "
                    f"if it stays slow, drain that node and restart from the last checkpoint")
        if c == "data":
            t = one_rank(c)
            if t is not None:
                r = t[0]
                others = _others_median(f.rank_data_ms, r)
                return ("input straggler",
                        f"{_where(r, t[1])} waits {t[5]:.1f} ms a step for input on the {t[3]} of {f.steps} steps it "
                        f"paced, the other ranks {others:.1f} ms (median), and they wait for it in collectives: "
                        f"{pct} lost ({step}: {phases})",
                        f"fix {_where(r, t[1])}'s input pipeline: more DataLoader workers (num_workers), "
                        f"prefetch_factor, pin_memory; check that node's disk and CPU load")
            return ("input-bound",
                    f"every rank waits for input: {f.data_ms:.1f} ms of a {step} ({pct})",
                    "more DataLoader workers (num_workers), prefetch_factor and pin_memory, or faster storage; "
                    "move decoding and augmentation off the training thread")
        if c == "pipeline":
            worst = max(f.bubble, key=lambda b: (b[1] or 0.0)) if f.bubble else None
            b = (f"stage {worst[0]} idles {worst[1]:.0%} of the step against an ideal {worst[2]:.0%} "
                 if worst and worst[1] is not None and worst[2] is not None else "")
            return ("pipeline bubble", f"{b}({pct} lost to the bubble; {step})",
                    "more micro-batches (gradient accumulation steps) per step, or an interleaved schedule; "
                    "balance the stages' layers if one stage computes longer")
        return ("exposed communication",
                f"collectives wait {f.comm_ms:.1f} ms of a {step} not hidden by compute ({pct} beyond the "
                f"baseline share)",
                "larger DDP buckets (bucket_cap_mb) and overlap with backward; fewer, larger all-reduces "
                "(gradient accumulation with no_sync); check the network's bus bandwidth (`tracetop report`, collectives)")

    also: list[str] = []
    if over:
        bound, why, nxt = explain(over[0])
        also = [f"{explain(c)[0]} ({shares[c]:.0%})" for c in over[1:]]
    else:
        g = f.memory_growth
        if g is not None and g[2] - g[1] >= max(MEMORY_CREEP * g[1], MEMORY_CREEP_MIN_BYTES):
            bound = "memory"
            why = (f"rank {g[0]}'s memory grew from {g[1] / 2**20:.0f} MiB to {g[2] / 2**20:.0f} MiB over the run "
                   f"while no wait cost over {BOUND_SHARE:.0%} ({step}: {phases})")
            nxt = ("find what is held across steps (losses kept as tensors, growing caches); "
                   "set a budget (TRACETOP_MEMORY_BUDGET_BYTES) to be warned before it runs out")
        else:
            lost_all = sum(shares.values())
            bound = "compute"
            why = (f"the step is the ranks' own compute: {step} ({phases}); waits cost {lost_all:.0%} of the "
                   f"GPU time, none over {BOUND_SHARE:.0%}")
            nxt = ("make the compute cheaper: a larger micro-batch, mixed precision (bf16), torch.compile, "
                   "fused optimizers; declare flops_per_token to see MFU")
    return Verdict(f.run_id, bound, why, nxt, also, {c: round(v, 4) for c, v in shares.items()}, incidents)


# ----------------------------------------------------------------------------- rendering


def render(v: Verdict) -> str:
    """The paragraph: verdict, why, next (and the incidents the live engine named)."""
    lines = [f"verdict: {v.bound}-bound" if v.bound in ("compute", "memory") else f"verdict: {v.bound}",
             f"  why:  {v.why}" + (f"; also over {BOUND_SHARE:.0%}: {', '.join(v.also)}" if v.also else ""),
             f"  next: {v.next}"]
    if v.incidents:
        lines.append(f"  incidents named live ({len(v.incidents)}):")
        lines += [f"    - {i}" for i in v.incidents]
    return "\n".join(lines)


def verdict_of(con, run_id: str) -> Verdict:
    return judge(gather(con, run_id))


# ----------------------------------------------------------------------------- `tracetop summary`


def add_arguments(parser) -> None:
    parser.add_argument("file", help="a collector's DuckDB file (no collector holding it)")
    parser.add_argument("--run", default=None, help="which run (default: the latest)")
    parser.add_argument("--json", action="store_true", help="one JSON object: the verdict and the per-rank summary")


def run(args) -> int:
    import sys

    from collector.query.post_file import PostFileError, open_read_only, pick_run
    from collector.query.summary import render as render_summary
    from collector.query.summary import summarize

    try:
        con = open_read_only(args.file)
    except PostFileError as e:
        print(f"tracetop summary: {e}", file=sys.stderr)
        return 2
    try:
        try:
            run_id = pick_run(con, args.run)
        except PostFileError as e:
            print(f"tracetop summary: {args.file}: {e}", file=sys.stderr)
            return 2
        v = verdict_of(con, run_id)
        s = summarize(con, run_id)
    finally:
        con.close()
    if args.json:
        print(json.dumps({"run_id": run_id, "verdict": v.as_dict(), "summary": {
            "ranks": [dict(zip(("rank", "stage", "steps", "step_ms", "compute_ms", "collective_wait_ms",
                                "data_wait_ms"), r)) for r in s.ranks],
            "gaps": s.gaps}}, default=str))
    else:
        print(render(v))
        print()
        print(render_summary(s))
    return 0
