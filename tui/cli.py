"""`tracetop ui`: the terminal UI, live through a collector or on a finished run's file.

    tracetop                                  # live: the collector at $TRACETOP_COLLECTOR, else the default
    tracetop ui --collector ADDR [--run RUN]  # live: that collector, that run (default: its newest)
    tracetop ui FILE.duckdb [--run RUN]       # after the run: read-only, with a step scrubber

Live, y / n approve / reject a proposed action (Overview, Alerts & actions) through the
collector's Control.Submit, with --control-token-file FILE where the collector demands one.

Nothing answering, a file held by a collector, a file of a newer schema, an unknown run: the app
opens on a screen saying what happened and what to do (no traceback).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tracetop import env

    parser.add_argument("file", nargs="?", default=None, help="a finished run's DuckDB file (read-only replay)")
    parser.add_argument("--collector", default=None,
                        help=f"a running collector's address (default ${env.TRACETOP_COLLECTOR} or {env.DEFAULT_COLLECTOR})")
    parser.add_argument("--run", default=None, help="the run to show (default: the newest)")
    parser.add_argument("--interval-s", type=float, default=0.5, help="seconds between live snapshots (default 0.5)")
    from tracetop.wire.auth import add_client_arguments

    add_client_arguments(parser)
    parser.add_argument("--control-token-file", metavar="FILE", default=None,
                        help="the collector's control token, to approve / reject proposals with y / n "
                             f"(or ${env.TRACETOP_CONTROL_TOKEN_FILE}; it also grants queries)")


def make_app(args: argparse.Namespace):
    from tracetop import env
    from tui.app import TracetopApp
    from tui.sources import CollectorSource, FileSource

    if args.file and args.collector:
        raise SystemExit("tracetop ui: give a FILE or --collector ADDR, not both")
    if args.file:
        return TracetopApp(FileSource(args.file, args.run))
    from tracetop.wire.auth import AuthSetupError, client_auth_from_args

    try:
        auth = client_auth_from_args(args)
        control_token = control_token_of(getattr(args, "control_token_file", None))
    except AuthSetupError as e:
        raise SystemExit(f"tracetop ui: {e}") from None
    return TracetopApp(CollectorSource(env.collector(args.collector), args.run, auth=auth, control_token=control_token),
                       interval_s=args.interval_s)


def control_token_of(path: str | None) -> str | None:
    """The control token: --control-token-file, then $TRACETOP_CONTROL_TOKEN_FILE, then none.
    Raises AuthSetupError for a file that cannot serve (unreadable, readable by others, not one token)."""
    from tracetop import env
    from tracetop.wire.auth import AuthSetupError, read_tokens

    path = path or env.get(env.TRACETOP_CONTROL_TOKEN_FILE)
    if not path:
        return None
    tokens = read_tokens(path, "control token file")
    if len(tokens) != 1:
        raise AuthSetupError(f"control token file {path} holds {len(tokens)} tokens; the TUI presents one")
    return next(iter(tokens))


def run(args: argparse.Namespace) -> int:
    if args.interval_s <= 0:
        print("tracetop ui: --interval-s must be above 0, e.g. 0.5", file=sys.stderr)
        return 2
    if args.file and args.collector:
        print("tracetop ui: give a FILE or --collector ADDR, not both", file=sys.stderr)
        return 2
    app = make_app(args)
    rc = app.run()
    return int(rc or 0)
