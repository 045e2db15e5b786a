"""`tracetop alerts FILE | --collector ADDR [--firing] [--incidents] [--recompute] [--json]`: the
alerts the live engine stored (firing and resolved), or with --recompute (FILE only) the alerts the
same rules find over the file's stored rows, post-mortem (collector/live/replay.py; the rules it
cannot judge from a file are named on stderr, each with why).

Alerts come grouped by incident: each cause (a fault: `role` cause) first, its consequences (the
SLA breaches and waiters it explains: `role` consequence) right under it, then standalone SLA
breaches (`role` empty), in the order the incidents began. `--incidents` gives one row per
incident (the `incidents` view: culprit, cause, steps, consequences). A file from before incidents
(schema 11 and older) reads as it did, without the kind and role columns."""

from __future__ import annotations

import argparse
import sys

_COLUMNS = "state, severity, rule, run_id, scope, labels, first_step, last_step, value, threshold, message"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", help="a collector's DuckDB file (after the run)")
    parser.add_argument("--collector", metavar="ADDR", help="ask a running collector instead")
    parser.add_argument("--firing", action="store_true", help="only the alerts firing now")
    parser.add_argument("--incidents", action="store_true",
                        help="one row per incident (culprit, cause, first/last step, consequences) instead of alerts")
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
    def cond(t: str = "") -> str:
        where = [f"{t}state = 'firing'"] if args.firing else []
        if args.run:
            where.append(f"{t}run_id IN (" + ", ".join("'" + r.replace("'", "''") + "'" for r in args.run) + ")")
        return (" WHERE " + " AND ".join(where)) if where else ""

    incidents = True if args.collector else _has_incidents(args.file)
    if incidents is None:
        return _usage(f"{args.file}: no such file")
    if args.incidents:
        if not incidents:
            return _usage(f"{args.file} predates incidents (collector file schema 11 or older): no incidents view; "
                          "`tracetop alerts FILE` lists its alerts")
        sql = (f"SELECT state, severity, rule AS cause_rule, cause, run_id, rank, stage, first_step, last_step, "
               f"consequences, consequence_rules, consequences_firing, message, incident_id FROM incidents{cond()} "
               "ORDER BY first_ns, rule")
    elif incidents:
        sql = (f"SELECT {_GROUPED} FROM alerts a LEFT JOIN (SELECT id AS cause_id, first_ns AS cause_ns FROM alerts) c "
               f"ON c.cause_id = a.incident_id{cond('a.')} "
               "ORDER BY coalesce(c.cause_ns, a.first_ns), coalesce(nullif(a.incident_id, ''), a.id), "
               "a.incident_id = a.id DESC, a.first_ns, a.rule")
    else:
        sql = f"SELECT {_COLUMNS}, rank, stage, first_ns, fired_ns, fired_step, last_ns, id FROM alerts{cond()} ORDER BY first_ns, rule"
    from collector.query import cli as query_cli

    if args.collector:
        return query_cli.via_collector(args.collector, sql, args)
    return query_cli.on_file([args.file], sql, args)


#: the alerts grouped by incident (schema 12 and later)
_GROUPED = ("a.state, a.kind, CASE WHEN a.incident_id = '' THEN '' WHEN a.incident_id = a.id THEN 'cause' "
            "ELSE 'consequence' END AS role, a.severity, a.rule, a.run_id, a.scope, a.labels, a.first_step, a.last_step, "
            "a.value, a.threshold, a.message, a.rank, a.stage, a.first_ns, a.fired_ns, a.fired_step, a.last_ns, "
            "a.incident_id, a.id")


def _has_incidents(path: str) -> bool | None:
    """Does the file's alerts table have the incident columns (schema 12+)? None: no such file."""
    import os

    from collector.ingest.schema import SchemaError, connect

    if not os.path.exists(path):
        return None
    try:
        con = connect(path, read_only=True)
    except SchemaError:
        return True  # held by a collector: let the query say so
    try:
        return bool(con.execute("SELECT count(*) FROM information_schema.columns WHERE table_name = 'alerts' "
                                "AND column_name = 'incident_id'").fetchone()[0])
    finally:
        con.close()


def grouped(alerts: list) -> list:
    """Alerts in incident order: each cause, then its consequences, then the next; standalone ones
    at their own time (what `tracetop alerts` prints, for Alert records)."""
    by_id = {a.id: a for a in alerts}

    def key(a):
        cause = by_id.get(a.incident_id) if a.incident_id else None
        head = cause if cause is not None else a
        return (head.first_ns, head.id, a.incident_id != a.id, a.first_ns, a.rule)

    return sorted(alerts, key=key)


def _recompute(args: argparse.Namespace) -> int:
    import json
    import os

    from collector.ingest.schema import SchemaError, connect
    from collector.live import rules as R
    from collector.live.replay import not_recomputed, recompute
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
    if args.incidents:
        return _usage("--incidents reads the stored incidents view; with --recompute the rows carry kind and role")
    rows = [{"state": a.state, "kind": a.kind, "role": a.role, "severity": a.severity, "rule": a.rule,
             "run_id": a.run_id, "scope": a.scope,
             "labels": json.dumps(dict(a.labels), sort_keys=True), "first_step": a.first_step, "last_step": a.last_step,
             "value": a.value, "threshold": a.threshold, "message": a.message,
             "rank": int(a.labels["rank"]) if "rank" in a.labels else None, "incident_id": a.incident_id}
            for a in grouped(found) if a.state != "pending"]
    if args.json:
        json.dump(rows, sys.stdout)
        sys.stdout.write("\n")
    else:
        names = list(rows[0]) if rows else _COLUMNS.split(", ")
        sys.stdout.write(format_table(names, [[r[n] for n in names] for r in rows]))
    for name, why in not_recomputed(rules):  # its absence above says nothing about the run
        print(f"tracetop alerts: rule {name} is not recomputed: {why}", file=sys.stderr)
    return 0
