"""What `tracetop control` and `tracetop profile` share as clients of the collector's Control service:
their common flags, who asks, and what a failed call means, in words and exit codes."""

from __future__ import annotations

import argparse
import getpass
import sys

EXIT_REFUSED = 2
EXIT_UNREACHABLE = 3


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """--collector, --reason, --by and the client's auth flags (a collector with --control-token-file
    wants that token)."""
    from tracetop import env
    from tracetop.wire.auth import add_client_arguments

    parser.add_argument("--collector", default=None,
                        help=f"the collector's address (default ${env.TRACETOP_COLLECTOR}, else {env.DEFAULT_COLLECTOR})")
    parser.add_argument("--reason", default="", help="why, in words (stored with the action)")
    parser.add_argument("--by", default=None, help="who asks (default person:$USER)")
    add_client_arguments(parser)


def who(by: str | None) -> str:
    """--by, else the person at the keyboard."""
    if by:
        return by
    try:
        return f"person:{getpass.getuser()}"
    except Exception:  # no passwd entry (a container's uid)
        return "person:unknown"


def fail(prog: str, msg: str, code: int = EXIT_REFUSED) -> int:
    print(f"tracetop {prog}: {msg}", file=sys.stderr)
    return code


def rpc_failure(prog: str, e: object, addr: str) -> int:
    """A failed call: no collector there (exit 3) or the collector's refusal with its reason (exit 2)."""
    import grpc

    code = e.code() if isinstance(e, grpc.Call) else None
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return fail(prog, f"no collector answers at {addr} ({code.name}); start one or pass --collector",
                    EXIT_UNREACHABLE)
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    return fail(prog, f"refused, nothing sent: {details}")
