"""`tracetop collector --db PATH --listen ADDR`: gRPC ingest into one DuckDB file.

Prints one line when it listens (`tracetop collector: listening on ADDR, db PATH ...`). SIGTERM
or SIGINT: stop taking batches, commit and ack everything taken, close the file, exit 0.

This module is the edge: flags, then env vars, then defaults, resolved and checked here (a bad
value exits 2 with what to change), into a `collector.app.CollectorConfig`; `collector.app.start`
does the wiring.
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
        help=f"HOST:PORT (loopback only unless TLS or a token is given; port 0 picks one) or unix:///PATH "
        f"(default {env.DEFAULT_COLLECTOR})",
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on 127.0.0.1:PORT")
    parser.add_argument("--max-batch-mb", type=float, default=64, help="largest message accepted (default 64)")
    auth = parser.add_argument_group("access (a non-loopback address needs TLS with a token, or mutual TLS)")
    auth.add_argument("--token-file", metavar="FILE",
                      help="bearer tokens (one a line, mode 600) every RPC and /metrics scrape must present")
    auth.add_argument("--control-token-file", metavar="FILE",
                      help="the token that may command runs (Control); without it, commands are refused")
    auth.add_argument("--query-token-file", metavar="FILE",
                      help="the token that may query (Query, /metrics); with it, the --token-file tokens (the "
                      "ranks') may only ingest")
    auth.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (with --tls-key)")
    auth.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    auth.add_argument("--tls-client-ca", metavar="PEM", help="mutual TLS: accept only clients with a cert this CA signed")
    parser.add_argument("--query-timeout-s", type=float, default=30.0,
                        help="cut off a query through the collector after this long (default 30)")
    parser.add_argument("--max-query-rows", type=int, default=100_000,
                        help="the most rows one query through the collector returns (default 100000)")
    parser.add_argument("--max-query-mb", type=float, default=64.0,
                        help="the most MiB of results one query through the collector builds; past it the query "
                        "is refused (RESOURCE_EXHAUSTED) (default 64)")
    parser.add_argument("--memory-limit-mb", type=int, default=None,
                        help="cap DuckDB's memory for the file (ingest and queries together; default 3/8 of "
                        "--memory-cap-mb); a query needing more is refused, the collector lives on")
    parser.add_argument("--duckdb-threads", type=int, default=None,
                        help="DuckDB's threads for the file (default: half the cores, at least 1; more split "
                        "checkpoints and large queries, at more CPU per row: docs/benchmarks.md)")
    parser.add_argument("--memory-cap-mb", type=int, default=None, help="the collector's memory cap: DuckDB's limit "
                        "(unless --memory-limit-mb), the writer's queue, the live inbox and the live state are "
                        "sized from it; past them shippers are held (backpressure) and a world too large for the "
                        "live state is judged in part, counted (default: 1/8 of RAM, at most 1536)")
    parser.add_argument("--flush-rows", type=int, default=10_000, help="commit once this many rows wait")
    parser.add_argument("--flush-interval-s", type=float, default=0.5,
                        help="...or once the oldest waited this long (default 0.5)")
    parser.add_argument("--fresh-ship-s", type=float, default=None, metavar="S",
                        help="while a TUI (Query.Watch) shows a run, ask its ranks to ship every S seconds instead "
                        f"of their own TRACETOP_FLUSH_S (default ${env.TRACETOP_FRESH_SHIP_S} or "
                        f"{env.DEFAULT_FRESH_SHIP_S}; 0: never ask)")
    parser.add_argument("--verbose", action="store_true", help="log every commit (rows, milliseconds)")
    out = parser.add_argument_group("outputs (alerts and per-run gauges; a dead receiver never slows ingest)")
    out.add_argument("--alertmanager", metavar="URL", default=None,
                     help=f"push alerts to this Alertmanager (v2 API), e.g. http://127.0.0.1:9093 (or ${env.TRACETOP_ALERTMANAGER})")
    out.add_argument("--webhook", metavar="URL", default=None,
                     help=f"POST alerts as plain JSON to this URL (or ${env.TRACETOP_WEBHOOK})")
    out.add_argument("--otlp", metavar="ENDPOINT", default=None,
                     help=f"export gauges and alert counts over OTLP/gRPC: HOST:PORT or https://HOST:PORT (or ${env.TRACETOP_OTLP})")
    out.add_argument("--otlp-interval-s", type=float, default=None, help="seconds between OTLP exports (default 10)")
    parser.add_argument("--rules", default=None, metavar="FILE",
                        help="judge runs live with these rules (TOML; `tracetop rules defaults` prints the built-in "
                             "set); alerts go to the file's `alerts` table")
    parser.add_argument("--no-rules", action="store_true", help="no live judgments (default: the built-in rules)")
    parser.add_argument("--price-per-gpu-hour", type=float, default=None, metavar="PRICE",
                        help=f"what one GPU-hour costs: lost GPU-hours are also shown as money (gauges, the straggler "
                        f"alert); wins over ${env.TRACETOP_PRICE_PER_GPU_HOUR} and the rules file's [cost] table")
    parser.add_argument("--currency", default=None, help="the price's currency (default the [cost] table's, else USD)")
    parser.add_argument("--baseline", default=None, metavar="RUN_ID",
                        help="a run in this file that the scaling rules compare against")
    parser.add_argument("--controller", choices=("off", "advise", "auto"), default=None,
                        help="the closed loop's mode: off, advise (proposals a person approves; the default), "
                        "auto (acts within its bounds); wins over the TOML's [controller] mode")
    parser.add_argument("--controller-config", default=None, metavar="TOML",
                        help="a TOML file whose [controller] table sets the policies' thresholds and bounds")
    parser.add_argument("--unclosed-after-s", type=float, default=None,
                        help="a rank's telemetry silent this long without its clean close gets a GAP row "
                             "(reason unclosed:last_seq=N; default 30, 0 = off)")
    parser.add_argument("--command-ttl-s", type=float, default=None,
                        help="a command rank 0 has not received this long after approval is marked lost (default 600)")


MIN_BATCH_MB = 4


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from collector.app import CollectorConfig, start
    from collector.export import ExportConfigError, build
    from collector.ingest.schema import SchemaError
    from tracetop.errors import ListenError
    from tracetop.wire.auth import AuthSetupError, ServerAuth

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    if args.max_batch_mb < MIN_BATCH_MB:
        # Shippers seal batches of up to 3 MiB (tracetop.wire.shipper.BATCH_BYTES); a smaller cap would
        # refuse them with RESOURCE_EXHAUSTED, which names no batch, and they would be resent forever.
        print(f"tracetop collector: --max-batch-mb {args.max_batch_mb} is below {MIN_BATCH_MB}, the smallest that "
              "holds every shipper's batches (they are up to 3 MiB); use the default 64", file=sys.stderr)
        return 2

    from tracetop import env as tenv

    raw_fresh = args.fresh_ship_s if args.fresh_ship_s is not None else tenv.get(tenv.TRACETOP_FRESH_SHIP_S)
    try:
        fresh_ship_s = float(raw_fresh) if raw_fresh is not None else tenv.DEFAULT_FRESH_SHIP_S
    except ValueError:
        fresh_ship_s = -1.0
    if not fresh_ship_s >= 0:  # also NaN
        print(f"tracetop collector: --fresh-ship-s / {tenv.TRACETOP_FRESH_SHIP_S} {raw_fresh!r} is not a number of "
              "seconds >= 0 (0 turns freshness on demand off; the default is 1)", file=sys.stderr)
        return 2
    if (args.query_timeout_s <= 0 or args.max_query_rows <= 0 or not args.max_query_mb > 0
            or (args.memory_limit_mb is not None and args.memory_limit_mb < 64)
            or (args.duckdb_threads is not None and args.duckdb_threads < 1)):
        print("tracetop collector: --query-timeout-s, --max-query-rows, --max-query-mb and --duckdb-threads must be "
              "positive, --memory-limit-mb at least 64", file=sys.stderr)
        return 2
    try:
        auth = ServerAuth.from_files(
            token_file=args.token_file, control_token_file=args.control_token_file,
            query_token_file=args.query_token_file,
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        )
    except AuthSetupError as e:
        print(f"tracetop collector: {e}", file=sys.stderr)
        return 2

    # a token without TLS off loopback, TLS without client authentication: refused by check_listen

    try:
        exports = build(args)  # validates every output before anything starts
    except ExportConfigError as e:
        print(f"tracetop collector: {e}", file=sys.stderr)
        return 2
    rules = cost = None
    if not args.no_rules:
        from collector.live.lost import CostError, CostSettings, with_price
        from collector.live.rules import RulesError, defaults, load_all
        from tracetop import env

        try:
            rules, cost = load_all(args.rules) if args.rules else (defaults(), CostSettings())
            cost = with_price(cost, args.price_per_gpu_hour, env.get(env.TRACETOP_PRICE_PER_GPU_HOUR), args.currency)
        except RulesError as e:
            print(f"tracetop collector: refusing to start, the rules file is not usable:\n{e}", file=sys.stderr)
            return 2
        except CostError as e:
            print(f"tracetop collector: refusing to start: {e}", file=sys.stderr)
            return 2

    from collector.control.controller import SettingsError, load_settings

    try:
        controller = load_settings(args.controller_config, mode=args.controller)
    except SettingsError as e:
        print(f"tracetop collector: {e}", file=sys.stderr)
        return 2

    from collector.app import roll_nice, roll_quiet_s, switch_interval_s

    try:
        sys.setswitchinterval(switch_interval_s())
        nice, quiet = roll_nice(), roll_quiet_s()
    except ValueError as e:
        print(f"tracetop collector: {e}", file=sys.stderr)
        return 2

    config = CollectorConfig(
        args.db,
        args.listen,
        max_batch_mb=args.max_batch_mb,
        metrics_port=args.metrics_port,
        auth=auth,
        query_timeout_s=args.query_timeout_s,
        max_query_rows=args.max_query_rows,
        max_query_bytes=int(args.max_query_mb * 2**20),
        memory_limit_mb=args.memory_limit_mb,
        memory_cap_mb=args.memory_cap_mb,
        duckdb_threads=args.duckdb_threads,
        roll_nice=nice,
        roll_quiet_s=quiet,
        flush_rows=args.flush_rows,
        flush_interval_s=args.flush_interval_s,
        rules=rules,
        cost=cost,
        baseline=args.baseline,
        command_ttl_s=args.command_ttl_s,
        controller=controller,
        unclosed_after_s=args.unclosed_after_s,
        fresh_ship_s=fresh_ship_s,
    )

    async def main() -> int:
        try:
            c = await start(config, exports=exports)
        except (ListenError, SchemaError) as e:
            exports.close()
            print(f"tracetop collector: {e}", file=sys.stderr)
            return 2
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        from tracetop.procs import announce_collector

        sys.stdout.write(announce_collector(c.address, c.db_path, c.metrics_port) + "\n")  # one write: a log line never splits it
        sys.stdout.flush()
        await stop.wait()
        await c.shutdown()
        print("tracetop collector: stopped; everything acked is committed", flush=True)
        return 0

    return asyncio.run(main())
