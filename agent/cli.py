"""`tracetop agent`: run the node agent.

    tracetop agent --collector ADDR [--listen unix:///…/agent.sock] [--interval-s 1]
                   [--metrics-port N] [--spool-dir DIR --spool-max-mb N]

Hooks on this node find the agent through TRACETOP_ENDPOINT, or, when that is unset, the default
socket ($XDG_RUNTIME_DIR/tracetop/agent.sock, else /tmp/tracetop-<uid>/agent.sock: tracetop/env.py
default_agent_socket) if it exists. The agent creates that folder 0700 and refuses one another user
could control; the hooks check the folder and the listener's uid (SO_PEERCRED) before trusting it
(tracetop/wire/local.py).

`--fake-gpus N` replaces NVML with the fake backend shipped in agent/fake_nvml.py (N fake GPUs):
a test and demo aid for machines without GPUs, never for production.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tracetop import env

    p.add_argument(
        "--collector",
        default=None,
        help=f"collector address (default: ${env.TRACETOP_COLLECTOR} or {env.DEFAULT_COLLECTOR})",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=None,
        help=f"where hooks ship to: unix:///PATH or 127.0.0.1:PORT; repeatable (default {env.default_agent_socket()})",
    )
    p.add_argument("--interval-s", type=float, default=1.0, help="sampling interval in seconds (default 1)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (0 = any free port)",
    )
    p.add_argument(
        "--metrics-addr", default="127.0.0.1", help="address of the metrics endpoint (default loopback)"
    )
    g = p.add_argument_group("who may scrape /metrics (a non-loopback --metrics-addr needs TLS or a token)")
    g.add_argument("--metrics-token-file", metavar="FILE", default=None,
                   help="scrapes must send `Authorization: Bearer <a token in FILE>` (401 otherwise); "
                        "default: the --token-file the agent presents to the collector, if any")
    g.add_argument("--metrics-tls-cert", metavar="PEM", default=None, help="serve /metrics over HTTPS with this certificate")
    g.add_argument("--metrics-tls-key", metavar="PEM", default=None, help="its private key")
    g.add_argument("--metrics-tls-client-ca", metavar="PEM", default=None,
                   help="mutual TLS: scrapers must present a certificate this CA signed")
    p.add_argument(
        "--spool-dir",
        default=None,
        help=f"disk spool folder (default ${env.TRACETOP_SPOOL_DIR} or {env.DEFAULT_SPOOL_DIR})",
    )
    p.add_argument("--spool-max-mb", type=float, default=1024.0, help="spool bound in MiB (default 1024)")
    p.add_argument(
        "--run-id",
        default=None,
        help="run id of the agent's own rows (default $TRACETOP_RUN_ID or agent-<node>)",
    )
    p.add_argument("--node", default=None, help="node name in the rows (default: the hostname)")
    p.add_argument(
        "--clock-interval-s",
        type=float,
        default=60.0,
        help="seconds between clock-offset measurements (0 = off)",
    )
    p.add_argument(
        "--fake-gpus", type=int, default=None, metavar="N", help="test/demo aid: N fake GPUs instead of NVML"
    )
    p.add_argument("--log-level", default="WARNING", help="python logging level (default WARNING)")
    from tracetop.wire.auth import add_client_arguments

    add_client_arguments(p)


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import sys
    import threading

    from agent.daemon import Agent, AgentConfig
    from tracetop import env
    from tracetop.errors import ListenError

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING), format="%(name)s: %(message)s"
    )
    if args.interval_s <= 0:
        print(f"tracetop agent: --interval-s must be > 0, got {args.interval_s}", file=sys.stderr)
        return 2
    if args.spool_max_mb <= 0:
        print(f"tracetop agent: --spool-max-mb must be > 0, got {args.spool_max_mb}", file=sys.stderr)
        return 2
    from tracetop.wire.auth import AuthSetupError, ServerAuth

    try:
        metrics_auth = ServerAuth.from_files(
            token_file=args.metrics_token_file or args.token_file or env.get(env.TRACETOP_TOKEN_FILE),
            tls_cert=args.metrics_tls_cert, tls_key=args.metrics_tls_key, tls_client_ca=args.metrics_tls_client_ca)
    except AuthSetupError as e:
        print(f"tracetop agent: /metrics: {e}", file=sys.stderr)
        return 2
    if args.metrics_addr not in ("127.0.0.1", "localhost", "::1") and not metrics_auth.closed:
        print(
            f"tracetop agent: refusing --metrics-addr {args.metrics_addr}: not loopback, and /metrics would be open "
            "to anyone; give --metrics-tls-cert/--metrics-tls-key (HTTPS) or --metrics-token-file (a bearer token)",
            file=sys.stderr,
        )
        return 2
    backend = None
    if args.fake_gpus is not None:
        from agent.fake_nvml import FakeNVML

        backend = FakeNVML(args.fake_gpus)
    from tracetop.wire.auth import client_auth_from_args

    try:
        auth = client_auth_from_args(args)
    except AuthSetupError as e:
        print(f"tracetop agent: {e}", file=sys.stderr)
        return 2
    cfg = AgentConfig(
        auth=auth,
        collector=env.collector(args.collector),
        listen=args.listen or [env.default_agent_socket()],
        interval_s=args.interval_s,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        metrics_auth=metrics_auth,
        spool_dir=args.spool_dir
        or env.get(env.TRACETOP_SPOOL_DIR, env.DEFAULT_SPOOL_DIR)
        or env.DEFAULT_SPOOL_DIR,
        spool_max_bytes=int(args.spool_max_mb * (1 << 20)),
        run_id=args.run_id,
        node=args.node,
        clock_interval_s=args.clock_interval_s,
    )
    agent = Agent(cfg, nvml_backend=backend)
    try:
        agent.start()
    except (ListenError, OSError) as e:
        print(f"tracetop agent: {e}", file=sys.stderr)
        agent.stop(0.1)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    gpus = len(agent.nvml.handles) if agent.nvml else 0
    from tracetop.procs import announce_agent

    scheme = "https" if metrics_auth.tls_cert is not None else "http"
    metrics_url = f"{scheme}://{cfg.metrics_addr}:{agent.metrics_port}/metrics" if agent.metrics_port is not None else None
    listening = agent.relay.addresses() if agent.relay else cfg.listen
    sys.stdout.write(announce_agent(listening, gpus, cfg.collector, str(cfg.spool_dir), metrics_url) + "\n")  # one write: a log line never splits it
    sys.stdout.flush()
    try:
        agent.run(stop)
    finally:
        agent.stop()
    return 0
