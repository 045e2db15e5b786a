"""`tracetop actions FILE | --collector [ADDR]`: every action and its life, newest last.

Add `--ranks` for every rank's report (which step, applied or refused, its message); `--json`
or `--csv` as `tracetop query`.
"""

from __future__ import annotations

import argparse

ACTIONS_SQL = ("SELECT action_id, run_id, kind, value, value_list, previous_value, state, step, ranks_applied, ranks_refused, "
               "ranks_undone, ranks_expected, rule, proposed_by, approved_by, rollback_of, outcome, verification, reason, "
               "expected FROM actions ORDER BY try_cast(action_id AS BIGINT), action_id")
RANKS_SQL = ("SELECT action_id, run_id, rank, stage, step, micro_batch, micro_batches, message FROM action_ranks "
             "ORDER BY try_cast(action_id AS BIGINT), rank, reported_ns")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", help="a collector's DuckDB file (or use --collector)")
    parser.add_argument("--collector", nargs="?", const="", default=None, metavar="ADDR",
                        help="ask a running collector (default address: $TRACETOP_COLLECTOR)")
    parser.add_argument("--ranks", action="store_true", help="every rank's report instead of one row per action")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true")
    fmt.add_argument("--json", action="store_true")
    parser.add_argument("--max-rows", type=int, default=100_000)
    from tracetop.wire.auth import add_client_arguments

    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from collector.query import cli as query_cli
    from tracetop import env

    sql = RANKS_SQL if args.ranks else ACTIONS_SQL
    if args.collector is not None:
        if args.file:
            return query_cli.refuse("give a FILE or --collector ADDR, not both")
        return query_cli.via_collector(env.collector(args.collector or None), sql, args)
    if not args.file:
        return query_cli.refuse("give a collector's FILE, or --collector ADDR")
    return query_cli.on_file(args.file, sql, args)
