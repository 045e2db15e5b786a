"""`tracetop profile --collector ADDR --run RUN [--ranks 3,7] --steps N`: torch's profiler on the named
ranks for the next N steps of a running job; the trace lands in the collector's file.

Default ranks: those the run's firing alerts name (its open incidents). A control-role operation
(a collector with --control-token-file wants that token). It submits a PROFILE action (the command
path: every rank receives it at the same step boundary; trainer_hooks/profiling.py), waits for the
ranks' answer, then for each trace, and prints the window's steps, the step time before, during
and after it (the named rank's `step` rows: the median of up to --compare-steps steps each side),
and how to open the trace (`tracetop export FILE --perfetto OUT.json`).

Exit codes: 0 stored; 2 refused (a bad request, a rank that cannot profile: the reason is printed);
3 no collector answers; 4 no answer in --timeout-s (the action stays in `tracetop actions`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from collector.control import client
from collector.control.client import EXIT_REFUSED

EXIT_TIMEOUT = 4
FINAL = ("applied", "verified", "rejected", "lost", "inconsistent", "incomplete", "dismissed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="the run id")
    parser.add_argument("--ranks", default="", metavar="R,R",
                        help="the ranks to profile (default: the ranks the run's firing alerts name)")
    parser.add_argument("--steps", type=int, required=True, metavar="N", help="steps to profile (1..100)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="how long to wait for the window and its trace (default 600)")
    parser.add_argument("--compare-steps", type=int, default=10, metavar="M",
                        help="steps before and after the window whose median time is shown (default 10; 0: do not wait)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    client.add_common_arguments(parser)


def _fail(msg: str, code: int = EXIT_REFUSED) -> int:
    return client.fail("profile", msg, code)


def parse_ranks(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--ranks {text!r}: give rank numbers separated by commas, e.g. 0,3") from None


def run(args: argparse.Namespace) -> int:
    import grpc

    from tracetop import env
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc
    from tracetop.wire.auth import AuthSetupError, client_auth_from_args

    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as e:
        return _fail(str(e))
    try:
        auth = client_auth_from_args(args)
    except AuthSetupError as e:
        return _fail(str(e))
    addr = env.collector(args.collector)
    with auth.channel(addr) as channel:
        control, query = pb_grpc.ControlStub(channel), pb_grpc.QueryStub(channel)
        md = auth.metadata()

        def sql(text: str, params: tuple = ()) -> list[dict]:
            from collector.query import readonly

            for p in params:  # the Query service takes SQL text: quote what is put in it
                text = text.replace("?", "'" + str(p).replace("'", "''") + "'", 1)
            reply = query.Sql(pb.QueryRequest(sql=text), timeout=60, metadata=md)
            return readonly.from_ipc(reply.arrow_ipc).to_pylist()

        try:
            if not ranks:
                rows = sql("SELECT DISTINCT rank FROM alerts WHERE run_id = ? AND state = 'firing' "
                           "AND rank IS NOT NULL ORDER BY rank", (args.run,))
                ranks = [int(r["rank"]) for r in rows]
                if not ranks:
                    return _fail(f"no firing alert of run {args.run} names a rank; say which: --ranks 0,3")
            req = pb.ControlRequest(run_id=args.run, op=pb.PROPOSE, kind=pb.PROFILE, int_value=args.steps,
                                    values=ranks, approve=True, rule="manual", by=client.who(args.by),
                                    reason=args.reason or f"profile {args.steps} steps on ranks {ranks}",
                                    expected=f"a trace of {args.steps} steps from ranks {ranks}")
            reply = control.Submit(req, timeout=30, metadata=md)
            result = _follow(sql, args, reply.action_id, ranks)
        except grpc.RpcError as e:
            return client.rpc_failure("profile", e, addr)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        _print(result)
    return int(result["exit"])


def _follow(sql: Any, args: argparse.Namespace, action_id: str, ranks: list[int]) -> dict:
    deadline = time.monotonic() + args.timeout_s
    out: dict[str, Any] = {"action_id": action_id, "run_id": args.run, "ranks": ranks, "steps": args.steps,
                           "exit": EXIT_TIMEOUT}
    action: dict = {}
    while time.monotonic() < deadline:
        rows = sql("SELECT state, step, outcome FROM actions WHERE action_id = ?", (action_id,))
        action = rows[0] if rows else {}
        if action.get("state") in FINAL:
            break
        time.sleep(0.5)
    out["state"], out["outcome"], out["boundary_step"] = action.get("state"), action.get("outcome"), action.get("step")
    if action.get("state") not in ("applied", "verified"):
        out["exit"] = EXIT_REFUSED if action.get("state") in FINAL else EXIT_TIMEOUT
        return out
    traces: list[dict] = []
    while time.monotonic() < deadline:
        traces = sql("SELECT rank, state, first_step, steps, start_ns, end_ns, bytes, note FROM profile_traces "
                     "WHERE run_id = ? AND action_id = ? ORDER BY rank", (args.run, action_id))
        if len(traces) >= len(ranks):
            break
        time.sleep(0.5)
    out["traces"] = traces
    if len(traces) < len(ranks):
        return out
    m = max(0, args.compare_steps)
    for t in traces:
        first, n = int(t["first_step"]), int(t["steps"] or 0)
        last = first + n - 1
        while m and time.monotonic() < deadline:  # the steps after the window, to show its cost is gone
            got = sql("SELECT max(step) AS s FROM step WHERE run_id = ? AND rank = ?", (args.run, t["rank"]))
            top = got[0]["s"] if got else None
            if top is not None and top >= last + m:
                break
            time.sleep(0.5)
        rows = sql("SELECT step, duration_ns FROM step WHERE run_id = ? AND rank = ? AND step BETWEEN ? AND ? "
                   "ORDER BY step", (args.run, t["rank"], first - m, last + m))
        by = {int(r["step"]): int(r["duration_ns"]) for r in rows}
        t["before_ms"] = _median_ms([v for s, v in by.items() if s < first])
        t["during_ms"] = _median_ms([v for s, v in by.items() if first <= s <= last])
        t["after_ms"] = _median_ms([v for s, v in by.items() if s > last])
        t["window_step_ms"] = {s: round(v / 1e6, 3) for s, v in sorted(by.items()) if first <= s <= last}
    out["exit"] = 0 if all(t["state"] == "stored" for t in traces) else EXIT_REFUSED
    return out


def _median_ms(values: list[int]) -> float | None:
    return round(statistics.median(values) / 1e6, 3) if values else None


def _print(r: dict) -> None:
    print(f"action {r['action_id']}: {r.get('state')}" + (f" ({r['outcome']})" if r.get("outcome") else ""))
    for t in r.get("traces", ()):
        first, n = int(t["first_step"]), int(t["steps"] or 0)
        if t["state"] != "stored":
            print(f"rank {t['rank']}: no trace stored: {t['note']}")
            continue
        print(f"rank {t['rank']}: steps {first}..{first + n - 1} profiled, trace {t['bytes'] / 1024:.0f} KiB gzip'd "
              "stored" + (f" ({t['note']})" if t.get("note") else ""))
        print(f"  step time (median ms): before {t.get('before_ms')}, during {t.get('during_ms')}, "
              f"after {t.get('after_ms')}")
    if r.get("traces"):
        lo = min(int(t["first_step"]) for t in r["traces"])
        hi = max(int(t["first_step"]) + int(t["steps"] or 1) - 1 for t in r["traces"])
        print(f"open it: tracetop export FILE.duckdb --perfetto profile.json --run {r['run_id']} --steps {lo}:{hi} "
              "(then ui.perfetto.dev); `tracetop report` lists it")
