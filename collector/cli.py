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
    parser.add_argument("--controller", choices=("off", "advise", "auto"), default=None,
                        help="the closed loop's mode: off, advise (proposals a person approves; the default), "
                        "auto (acts within its bounds); wins over the TOML's [controller] mode")
    parser.add_argument("--controller-config", default=None, metavar="TOML",
                        help="a TOML file whose [controller] table sets the policies' thresholds and bounds")
    parser.add_argument("--command-ttl-s", type=float, default=None,
                        help="a command rank 0 has not received this long after approval is marked lost (default 600)")


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

    from collector.control.controller import SettingsError, load_settings

    try:
        controller = load_settings(args.controller_config, mode=args.controller)
    except SettingsError as e:
        print(f"tracetop collector: {e}", file=sys.stderr)
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
                command_ttl_s=args.command_ttl_s,
                controller=controller,
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
