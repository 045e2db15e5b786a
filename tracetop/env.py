"""Every environment variable tracetop reads, with what it means. The one place they are named.

Configuration order everywhere: an explicit argument or CLI flag, then the variable here, then
the default given here.
"""

from __future__ import annotations

import os

TRACETOP_ENDPOINT = "TRACETOP_ENDPOINT"
"""Where hooks ship events: an agent socket (``unix:///run/tracetop/agent.sock``) or a collector
address (``127.0.0.1:7000``, ``unix:///tmp/c.sock``). Default: default_agent_socket() if that socket
exists, else the collector (TRACETOP_COLLECTOR, DEFAULT_COLLECTOR). A unix socket is used only if no
other user could control it (its folder and its listener: tracetop/wire/local.py); else the hooks
ship to the collector, and say so."""

TRACETOP_RUN_ID = "TRACETOP_RUN_ID"
"""The run every event belongs to (1-128 chars of ``[A-Za-z0-9._:-]``). Default: derived from the
launcher's job id (TORCHELASTIC_RUN_ID, SLURM_JOB_ID) or a timestamp chosen by rank 0."""

TRACETOP_DISABLE = "TRACETOP_DISABLE"
"""``1`` turns every hook into a no-op (nothing is timed, nothing is shipped)."""

TRACETOP_COLLECTOR = "TRACETOP_COLLECTOR"
"""Where the TUI and ``tracetop query --collector`` look for a collector. Default: DEFAULT_COLLECTOR."""

TRACETOP_SPOOL_DIR = "TRACETOP_SPOOL_DIR"
"""The agent's disk spool folder. Default: ``/var/tmp/tracetop-spool-<uid>``, created 0700; a folder
that is a symlink, another user's, or writable by others is refused."""

TRACETOP_HEARTBEAT_S = "TRACETOP_HEARTBEAT_S"
"""Seconds between a rank's heartbeats. Default: 5."""

TRACETOP_NODE = "TRACETOP_NODE"
"""The node name the hooks report for the rank (run_start.hostname: comm_topology's nodes).
Default: the host's name (socket.gethostname())."""

TRACETOP_FLUSH_S = "TRACETOP_FLUSH_S"
"""Seconds between a rank's shipments (one batch per kind each time); the hooks' emitter also
drains its rows into the shipper at this interval, so a step's row leaves the rank at most this
long after the step. Lower means a fresher live view and more CPU spent shipping (at 1 s the
hooks' threads' share of step time read 1.22% against 0.27% at 5 s, 0.81% at 2 s: measured in
docs/benchmarks.md, "The hooks' cost"; against the 1% overhead bar, too much to be the default).
Default: 5."""

TRACETOP_EXIT_FLUSH_S = "TRACETOP_EXIT_FLUSH_S"
"""Seconds a rank's hooks may hold the end of its process (SIGTERM, SIGINT, interpreter exit) to
ship what they hold and wait for the acks, before the process ends as it would have
(trainer_hooks/shutdown.py). Default: 2."""

TRACETOP_HANDOVER_S = "TRACETOP_HANDOVER_S"
"""Where the hooks ship to a unix socket (the node agent's, or a collector on the same host), they
hand a finished step's rows over at its end, at most this often, instead of every
TRACETOP_FLUSH_S: a rank killed outright (SIGKILL, OOM) then loses at most about a step, or this
long of steps when steps are shorter (and a neighbour counts them: trainer_hooks/progress.py).
Each handover costs the rank one shipment (~2-4 ms of CPU: docs/benchmarks.md; 1.6 ms measured
beside 50 ms steps, docs/reliability.md). A value below the step time (e.g. 0.01) hands over every
step: at most about one step lost, for that CPU each step. 0 turns it off. Default: 0.5."""

TRACETOP_FRESH_SHIP_S = "TRACETOP_FRESH_SHIP_S"
"""Collector: while a Query.Watch stream (the TUI) watches a run, the seconds between that run's
shipments the collector asks for in its Ingest.Push replies (the shippers go back to their own
TRACETOP_FLUSH_S once nobody watches). 0 turns it off. Default: 1."""

TRACETOP_BUFFER_BYTES = "TRACETOP_BUFFER_BYTES"
"""Bytes of unacked telemetry one rank's hooks keep in memory while their endpoint is unreachable.
Beyond it the oldest batches are dropped, counted and shipped as gap rows. Default: 256 MiB."""

TRACETOP_TOKEN_FILE = "TRACETOP_TOKEN_FILE"
"""A file holding the bearer token clients present to a collector that demands one (hooks, agents,
the TUI, ``tracetop query --collector``, ``tracetop control``); the flag ``--token-file`` wins. The file
must not be readable by other users. Default: no token."""

TRACETOP_CONTROL_TOKEN_FILE = "TRACETOP_CONTROL_TOKEN_FILE"
"""A file holding the control token (the one in the collector's ``--control-token-file``) that the
TUI presents to approve or reject a proposed action; the flag ``--control-token-file`` wins. It also
grants queries, so it may stand alone. Same file rules as TRACETOP_TOKEN_FILE. Default: none (a
collector with a control token file then refuses the TUI's approvals, with the reason on screen)."""

TRACETOP_TLS_CA = "TRACETOP_TLS_CA"
"""PEM file of the CA that signed the collector's TLS certificate; set, clients connect with TLS.
Default: plaintext (loopback and unix sockets only)."""

TRACETOP_TLS_CERT = "TRACETOP_TLS_CERT"
"""PEM client certificate for a collector that demands mutual TLS (with TRACETOP_TLS_KEY)."""

TRACETOP_TLS_KEY = "TRACETOP_TLS_KEY"
"""PEM private key of TRACETOP_TLS_CERT."""

TRACETOP_TLS_SERVER_NAME = "TRACETOP_TLS_SERVER_NAME"
"""The name to check in the collector's certificate when it differs from the address's host
(e.g. connecting by IP to a certificate issued for ``collector.internal``)."""

TRACETOP_ALERTMANAGER = "TRACETOP_ALERTMANAGER"
"""The collector's ``--alertmanager URL``: an Alertmanager's base URL (``http://127.0.0.1:9093``)
to push alerts to (v2 API). Default: none."""

TRACETOP_WEBHOOK = "TRACETOP_WEBHOOK"
"""The collector's ``--webhook URL``: where alerts are POSTed as plain JSON. Default: none."""

TRACETOP_OTLP = "TRACETOP_OTLP"
"""The collector's ``--otlp ENDPOINT``: an OTLP/gRPC endpoint (``HOST:PORT`` plaintext,
``https://HOST:PORT`` TLS) for the per-run gauges and alert counts. Default: none."""

TRACETOP_DDP_BUCKETS = "TRACETOP_DDP_BUCKETS"
"""``0`` leaves DDP's gradient all-reduce on its built-in C++ path: no comm hook, no DDP bucket rows,
the wait for them counted as backward compute (``trainer_hooks/integrations/ddp.py``). Default ``1``: timed."""

TRACETOP_MEMORY_BUDGET_BYTES = "TRACETOP_MEMORY_BUDGET_BYTES"
"""The memory one rank may use, in bytes (``Tracer(memory_budget_bytes=...)`` wins): the MEMORY rows
carry it beside the step's peak, and the controller keeps the peak under 0.90 of it. Default: none."""

TRACETOP_COMMAND_EVERY_STEPS = "TRACETOP_COMMAND_EVERY_STEPS"
"""K: every K steps all ranks join one 64-byte gloo broadcast from rank 0 that hands them a command
from the collector (or, most times, nothing); 0 turns commands off. Default: 10; 50 where the trainer
registered no ``on_command`` handler (the boundary then serves profiling windows alone)."""

TRACETOP_COMMAND_POLL_S = "TRACETOP_COMMAND_POLL_S"
"""Seconds between rank 0's ``Control.Poll`` calls for commands (a unary call; no stream is held
open). Default: 5."""

TRACETOP_TEST_DROP_COMMANDS = "TRACETOP_TEST_DROP_COMMANDS"
"""Tests only: rank 0 discards the commands it receives that match (``all``, or ``KEY=VALUE`` entries,
comma-separated, e.g. ``micro_batch=1,offload=on``), as if they were lost on the way to it."""

TRACETOP_PROFILE = "TRACETOP_PROFILE"
"""``0`` turns the on-demand profiling window off (``tracetop profile``; trainer_hooks/profiling.py): a
trainer that registered no ``on_command`` handler then runs no command boundary at all (with it on,
such a trainer runs one every 50 steps, or every TRACETOP_COMMAND_EVERY_STEPS where that is set). Default ``1``."""

TRACETOP_TEST_NO_PROFILER = "TRACETOP_TEST_NO_PROFILER"
"""Tests only: these ranks (``all``, or ranks comma-separated) act as if torch's profiler were missing
and refuse a profiling window, saying so."""

TRACETOP_PRICE_PER_GPU_HOUR = "TRACETOP_PRICE_PER_GPU_HOUR"
"""What one GPU-hour costs (a positive number, in the [cost] table's currency, default USD), for the
collector's and the report's ``--price-per-gpu-hour``: lost GPU-hours are then shown as money too.
The flag wins, then this variable, then the rules file's ``[cost] price_per_gpu_hour``. Default: none."""

TRACETOP_COMPACT_MAX_MB = "TRACETOP_COMPACT_MAX_MB"
"""The collector compacts its file at close (16 KiB blocks: collector/compact.py) when the file is at most
this many MB; ``0`` never. Default: 64."""

DEFAULT_COLLECTOR = "127.0.0.1:7000"
DEFAULT_SPOOL_DIR = f"/var/tmp/tracetop-spool-{os.geteuid()}"
"""One per user: a shared name lets one user's folder (refused: tracetop/wire/spool.py check_owned)
stop another's agent."""
DEFAULT_HEARTBEAT_S = 5.0
DEFAULT_HANDOVER_S = 0.5
DEFAULT_FRESH_SHIP_S = 1.0

# Three shipping intervals, one per kind of producer; each is that producer's own default.
DEFAULT_FLUSH_S = 5.0
"""A rank's hooks (TRACETOP_FLUSH_S): long, because every rank pays for each shipment in its own
CPU (see TRACETOP_FLUSH_S); the collector asks for DEFAULT_FRESH_SHIP_S while someone watches."""
AGENT_FLUSH_S = 1.0
"""The node agent's own rows (GPU and host samples): 1 s matches its 1 Hz sampling; hook batches
it relays are forwarded at once, not sealed by this interval."""
SHIPPER_FLUSH_S = 0.25
"""``Shipper``'s own default, for in-process producers that set nothing (tools, tests): a library
default that favours freshness; the two producers above pass theirs explicitly."""


def get(name: str, default: str | None = None) -> str | None:
    """The variable's value, or default when unset or empty."""
    value = os.environ.get(name, "")
    return value if value != "" else default


def disabled() -> bool:
    return get(TRACETOP_DISABLE, "0") not in ("0", "false", "False", "")


def endpoint(explicit: str | None = None) -> str:
    """Resolve where hooks ship: argument, then TRACETOP_ENDPOINT, then the local agent socket
    if it exists, then the default collector."""
    if explicit:
        return explicit
    value = get(TRACETOP_ENDPOINT)
    if value:
        return value
    agent = default_agent_socket()
    if os.path.exists(agent[len("unix://") :]):
        return agent
    return DEFAULT_COLLECTOR


def default_agent_dir() -> str:
    """The node agent's default socket folder, one per user: ``$XDG_RUNTIME_DIR/tracetop`` where
    that is set, else ``/tmp/tracetop-<uid>`` (the agent creates it 0700; tracetop/wire/local.py)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "tracetop")
    return f"/tmp/tracetop-{os.geteuid()}"


def default_agent_socket() -> str:
    """``unix://`` address of the agent's default socket: ``agent.sock`` in default_agent_dir()."""
    return f"unix://{default_agent_dir()}/agent.sock"


def collector(explicit: str | None = None) -> str:
    return explicit or get(TRACETOP_COLLECTOR, DEFAULT_COLLECTOR) or DEFAULT_COLLECTOR


def memory_budget_bytes(explicit: int | None = None) -> int:
    """The declared memory budget: the argument, then TRACETOP_MEMORY_BUDGET_BYTES, else -1 (none)."""
    if explicit is not None:
        return int(explicit)
    raw = get(TRACETOP_MEMORY_BUDGET_BYTES)
    if raw is None:
        return -1
    try:
        value = int(float(raw))
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{TRACETOP_MEMORY_BUDGET_BYTES}={raw!r}: give a positive number of bytes, e.g. 8000000000")
    return value
