"""`tracetop query FILE... "SQL"` or `tracetop query --collector [ADDR] "SQL"`: read-only SQL.

Directly on files no collector holds (opened read-only, external access off; several files are
presented as one, see collector/query/multifile.py), or through a running collector's Query service.
Options go anywhere on the line (`tracetop query FILE --json "SQL"`). Prints a table, or `--csv` / `--json` (a JSON array of
objects). Exit codes: 0 answered, 1 the SQL failed (syntax, missing table, ...), 2 refused
(writes, ATTACH, COPY, file reads, INSTALL) or unusable arguments.
"""

from __future__ import annotations

import argparse
import sys

from tracetop.text import printable

EXIT_OK, EXIT_SQL_ERROR, EXIT_REFUSED = 0, 1, 2
#: tracetop/cli.py parses this command with parse_intermixed_args: options anywhere on the line.
PARSE_INTERMIXED = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*", metavar="[FILE ...] SQL",
                        help="one or more collector DuckDB files (queried as one), then the SQL")
    parser.add_argument(
        "--collector",
        nargs="?",
        const="",
        default=None,
        metavar="ADDR",
        help="ask a running collector instead of opening a file (default address: $TRACETOP_COLLECTOR "
        "or 127.0.0.1:7000)",
    )
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV")
    fmt.add_argument("--json", action="store_true", help="print a JSON array of row objects")
    parser.add_argument("--max-rows", type=int, default=100_000, help="stop after this many rows (0 = all)")
    from tracetop.wire.auth import add_client_arguments

    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    positional = list(args.args)
    if args.collector is not None:
        from tracetop import env

        addr = args.collector
        if not positional and addr:  # `--collector "SQL"`: argparse took the SQL as ADDR
            addr, positional = "", [addr]
        if len(positional) != 1:
            return refuse("with --collector give only the SQL")
        return via_collector(env.collector(addr or None), positional[0], args)
    if len(positional) < 2:
        return refuse('give a FILE and the SQL: tracetop query FILE [FILE ...] "SQL" (or --collector ADDR "SQL")')
    return on_file(positional[:-1], positional[-1], args)


def refuse(msg: str) -> int:
    """Say why a query is refused (stderr) and return the exit code; `tracetop actions` and
    `tracetop alerts` answer the same way."""
    print(f"tracetop query: {msg}", file=sys.stderr)
    return EXIT_REFUSED


def on_file(paths: list[str], sql: str, args: argparse.Namespace) -> int:
    import os

    import duckdb

    from collector.ingest.schema import SchemaError, connect
    from collector.query import dashboard, readonly
    from collector.query.multifile import MultiFileError, connect_many

    for path in paths:
        if not os.path.exists(path):
            return refuse(f"{path}: no such file (to ask a running collector use --collector ADDR)")
    if len(set(map(os.path.realpath, paths))) != len(paths):
        return refuse("the same file is named twice; its rows would be counted twice")
    try:
        con = connect(paths[0], read_only=True) if len(paths) == 1 else connect_many(paths)
    except (SchemaError, MultiFileError) as e:
        print(f"tracetop query: {e}", file=sys.stderr)
        return EXIT_SQL_ERROR
    except duckdb.Error as e:
        print(f"tracetop query: cannot open {paths[0]}: {e}", file=sys.stderr)
        return EXIT_SQL_ERROR
    try:
        if len(paths) == 1:  # connect_many locks its own configuration
            dashboard.install(con)  # comm_topology, hardware_risk: views defined at query time
            con.execute("SET lock_configuration = true")
        table, truncated = readonly.run_read_only(con, sql, args.max_rows, max_bytes=None)  # your own file, your memory
    except Exception as e:
        if readonly.is_refusal(e):
            print(_refusal_text(e), file=sys.stderr)
            return EXIT_REFUSED
        if isinstance(e, duckdb.Error):
            print(f"tracetop query: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_SQL_ERROR
        raise
    finally:
        con.close()
    _print(table, truncated, args)
    return EXIT_OK


def _refusal_text(e: BaseException) -> str:
    text = str(e)
    if not text.startswith("tracetop query"):
        text = f"tracetop query is read-only and cannot touch the filesystem: {text.splitlines()[0]}"
    return text


def via_collector(addr: str, sql: str, args: argparse.Namespace) -> int:
    """Run ``sql`` through a running collector (Query.Sql) and print it as ``args`` ask."""
    import grpc

    from collector.query import readonly
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc
    from tracetop.wire.auth import AuthSetupError, client_auth_from_args

    try:
        auth = client_auth_from_args(args)
    except AuthSetupError as e:
        return refuse(str(e))
    opts = [("grpc.max_receive_message_length", 512 * 1024 * 1024)]
    with auth.channel(addr, options=opts) as channel:
        try:
            reply = pb_grpc.QueryStub(channel).Sql(pb.QueryRequest(sql=sql, max_rows=args.max_rows), timeout=300,
                                                    metadata=auth.metadata())
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) and "token" in (e.details() or ""):
                print(f"tracetop query: collector at {addr} refused: {code.name}: {e.details()}", file=sys.stderr)
                return EXIT_REFUSED
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                print(f"tracetop query: {e.details()}", file=sys.stderr)
                return EXIT_SQL_ERROR
            if code == grpc.StatusCode.PERMISSION_DENIED:
                print(_refusal_text(Exception(e.details())), file=sys.stderr)
                return EXIT_REFUSED
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                print(f"tracetop query: {e.details()}", file=sys.stderr)
                return EXIT_SQL_ERROR
            print(f"tracetop query: collector at {addr}: {code.name}: {e.details()}", file=sys.stderr)
            return EXIT_SQL_ERROR
    _print(readonly.from_ipc(reply.arrow_ipc), reply.truncated, args)
    return EXIT_OK


def _print(table, truncated: bool, args: argparse.Namespace, out=None) -> None:
    out = out or sys.stdout
    names = table.column_names
    rows = table.to_pylist()
    if args.csv:
        import csv

        w = csv.writer(out)
        safe = _on_a_terminal(out)  # CSV into a file is data for a program: kept exact
        w.writerow([printable(n) if safe else n for n in names])
        for r in rows:
            w.writerow(["" if r[n] is None else printable(str(r[n])) if safe and isinstance(r[n], str) else r[n]
                        for n in names])
    elif args.json:
        import json

        json.dump(rows, out, default=_json_default)
        out.write("\n")
    else:
        out.write(format_table(names, [[r[n] for n in names] for r in rows]))
    if truncated:
        print(f"tracetop query: output stopped at {len(rows)} rows (--max-rows)", file=sys.stderr)


def _json_default(v: object) -> object:
    from decimal import Decimal

    return float(v) if isinstance(v, Decimal) else str(v)


def _on_a_terminal(out) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):
        return False


def _cell(v: object) -> str:
    """A table cell for a person: what a rank sent never reaches the terminal as a control
    sequence (ESC, OSC 52, a screen clear): control characters, tab and newline show as U+FFFD."""
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    return printable(str(v), one_line=True)


def format_table(names: list[str], rows: list[list[object]]) -> str:
    """A plain aligned text table (numbers right-aligned), with a row count."""
    names = [printable(n, one_line=True) for n in names]
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    numeric = [all(isinstance(r[i], int | float) or r[i] is None for r in rows) for i in range(len(names))]

    def line(vals: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    out = [line(names), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out) + "\n"
