"""`tracetop token ingest`: the ranks' ingest-only token, derived from the operator's.

    tracetop token ingest --token-file OPERATOR_TOKEN [--out RANKS_TOKEN]

A collector started with ``--token-file OPERATOR_TOKEN`` accepts what this prints for ingest only
(the ranks and agents ship with it; a query or a command with it is refused, PERMISSION_DENIED).
Give the ranks the output through ``TRACETOP_TOKEN_FILE`` and keep the operator's file off the
training nodes. ``--out`` writes it to a new file of mode 0600 (refusing an existing one); without
it the token goes to stdout. Each line of a multi-token file gives one line (rotation).
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["ingest"], help="ingest: the ranks' ingest-only token")
    parser.add_argument("--token-file", required=True, metavar="FILE",
                        help="the operator's token file (the collector's --token-file)")
    parser.add_argument("--out", metavar="FILE", help="write the token to FILE (created 0600) instead of stdout")


def run(args: argparse.Namespace) -> int:
    from tracetop.wire.auth import AuthSetupError, ingest_token, read_tokens

    try:
        tokens = read_tokens(args.token_file, "--token-file")
    except AuthSetupError as e:
        print(f"tracetop token: {e}", file=sys.stderr)
        return 2
    text = "".join(ingest_token(t) + "\n" for t in sorted(tokens))
    if not args.out:
        sys.stdout.write(text)
        return 0
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        print(f"tracetop token: cannot create {args.out} ({e.strerror}); give a new file's path", file=sys.stderr)
        return 2
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return 0
