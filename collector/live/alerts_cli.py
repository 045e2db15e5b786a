"""`tracetop alerts FILE | --collector ADDR [--firing] [--recompute] [--json]`: the alerts the
live engine stored (firing and resolved), or with --recompute (FILE only) the alerts the same
rules find over the file's stored rows, post-mortem."""

from __future__ import annotations

import argparse
import sys

_COLUMNS = "state, severity, rule, run_id, scope, labels, first_step, last_step, value, threshold, message"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", help="a collector's DuckDB file (after the run)")
    parser.add_argument("--collector", metavar="ADDR", help="ask a running collector instead")
    parser.add_argument("--firing", action="store_true", help="only the alerts firing now")
    parser.add_argument("--recompute", action="store_true",
                        help="judge the file's stored rows again with --rules (default: the built-in rules)")
    parser.add_argument("--rules", metavar="FILE", help="rules for --recompute")
    parser.add_argument("--baseline", metavar="RUN_ID", help="baseline run for --recompute")
    parser.add_argument("--run", action="append", default=[], metavar="RUN_ID", help="only this run (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON array of rows")
    parser.add_argument("--csv", action="store_true", help="CSV with a header row")
    parser.add_argument("--max-rows", type=int, default=100_000)
    from tracetop.wire.auth import add_client_arguments

    add_client_arguments(parser)


def _usage(msg: str) -> int:
    print(f"tracetop alerts: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if bool(args.file) == bool(args.collector):
        return _usage("give a FILE or --collector ADDR (one of them)")
    if args.recompute:
        if not args.file:
            return _usage("--recompute reads a file: give FILE (after the run), not --collector")
        return _recompute(args)
    where = ["state = 'firing'"] if args.firing else []
    if args.run:
        where.append("run_id IN (" + ", ".join("'" + r.replace("'", "''") + "'" for r in args.run) + ")")
    sql = (f"SELECT {_COLUMNS}, rank, stage, first_ns, fired_ns, fired_step, last_ns, id FROM alerts"
           + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY first_ns, rule")
    from collector.query import cli as query_cli

    if args.collector:
        return query_cli.via_collector(args.collector, sql, args)
    return query_cli.on_file(args.file, sql, args)


def _recompute(args: argparse.Namespace) -> int:
    import json
    import os

    from collector.ingest.schema import SchemaError, connect
    from collector.live import rules as R
    from collector.live.replay import recompute
    from collector.query.cli import format_table

    if not os.path.exists(args.file):
        return _usage(f"{args.file}: no such file")
    try:
        rules = R.load(args.rules) if args.rules else R.defaults()
    except R.RulesError as e:
        print(f"tracetop alerts: the rules file is refused:\n{e}", file=sys.stderr)
        return 2
    try:
        con = connect(args.file, read_only=True)
    except SchemaError as e:
        print(f"tracetop alerts: {e}", file=sys.stderr)
        return 2
    try:
        found = recompute(con, rules, baseline=args.baseline, runs=args.run or None)
    finally:
        con.close()
    if args.firing:
        found = [a for a in found if a.state == "firing"]
    rows = [{"state": a.state, "severity": a.severity, "rule": a.rule, "run_id": a.run_id, "scope": a.scope,
             "labels": json.dumps(dict(a.labels), sort_keys=True), "first_step": a.first_step, "last_step": a.last_step,
             "value": a.value, "threshold": a.threshold, "message": a.message,
             "rank": int(a.labels["rank"]) if "rank" in a.labels else None} for a in found if a.state != "pending"]
    if args.json:
        json.dump(rows, sys.stdout)
        sys.stdout.write("\n")
    else:
        names = list(rows[0]) if rows else _COLUMNS.split(", ")
        sys.stdout.write(format_table(names, [[r[n] for n in names] for r in rows]))
    return 0
