"""`tracetop collector --db PATH --listen ADDR`: gRPC ingest into one DuckDB file.

Prints one line when it listens (`tracetop collector: listening on ADDR, db PATH ...`). SIGTERM
or SIGINT: stop taking batches, commit and ack everything taken, close the file, exit 0.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tracetop import env

    parser.add_argument("--db", required=True, help="the DuckDB file to write (created if missing)")
    parser.add_argument(
        "--listen",
        default=env.DEFAULT_COLLECTOR,
        help=f"HOST:PORT (loopback only unless --insecure-bind; port 0 picks one) or unix:///PATH "
        f"(default {env.DEFAULT_COLLECTOR})",
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on 127.0.0.1:PORT")
    parser.add_argument("--max-batch-mb", type=float, default=64, help="largest message accepted (default 64)")
    parser.add_argument(
        "--insecure-bind",
        action="store_true",
        help="allow a non-loopback listen address (no TLS or token auth exists yet)",
    )
    parser.add_argument("--flush-rows", type=int, default=10_000, help="commit once this many rows wait")
    parser.add_argument("--flush-interval-s", type=float, default=0.5, help="...or once the oldest waited this long")
    parser.add_argument("--verbose", action="store_true", help="log every commit (rows, milliseconds)")
    parser.add_argument("--rules", default=None, metavar="FILE",
                        help="judge runs live with these rules (TOML; `tracetop rules defaults` prints the built-in "
                             "set); alerts go to the file's `alerts` table")
    parser.add_argument("--no-rules", action="store_true", help="no live judgments (default: the built-in rules)")
    parser.add_argument("--baseline", default=None, metavar="RUN_ID",
                        help="a run in this file that the scaling rules compare against")


MIN_BATCH_MB = 4


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from collector.schema import SchemaError
    from collector.server import ListenError, start

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    if args.max_batch_mb < MIN_BATCH_MB:
        # Shippers seal batches of up to 3 MiB (tracetop.wire.shipper.BATCH_BYTES); a smaller cap would
        # refuse them with RESOURCE_EXHAUSTED, which names no batch, and they would be resent forever.
        print(f"tracetop collector: --max-batch-mb {args.max_batch_mb} is below {MIN_BATCH_MB}, the smallest that "
              "holds every shipper's batches (they are up to 3 MiB); use the default 64", file=sys.stderr)
        return 2

    rules = None
    if not args.no_rules:
        from collector.live.rules import RulesError, defaults, load

        try:
            rules = load(args.rules) if args.rules else defaults()
        except RulesError as e:
            print(f"tracetop collector: refusing to start, the rules file is not usable:\n{e}", file=sys.stderr)
            return 2

    async def main() -> int:
        try:
            c = await start(
                args.db,
                args.listen,
                max_batch_mb=args.max_batch_mb,
                metrics_port=args.metrics_port,
                insecure_bind=args.insecure_bind,
                flush_rows=args.flush_rows,
                flush_interval_s=args.flush_interval_s,
                rules=rules,
                baseline=args.baseline,
            )
        except (ListenError, SchemaError) as e:
            print(f"tracetop collector: {e}", file=sys.stderr)
            return 2
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        metrics = f", metrics on 127.0.0.1:{c.metrics_port}" if c.metrics_port is not None else ""
        print(f"tracetop collector: listening on {c.address}, db {c.db_path}{metrics}", flush=True)
        await stop.wait()
        await c.shutdown()
        print("tracetop collector: stopped; everything acked is committed", flush=True)
        return 0

    return asyncio.run(main())
