"""The Tracer: the façade a training loop sees (``step``, ``phase``, ``describe``, ``close``) over
per-rank recorders for steps, phases, collectives, pipeline instructions, offload copies, memory,
throughput and heartbeats, shipped through one sink (the Shipper).

Three parts, each its own module: :class:`trainer_hooks.recorder.Recorder` (what the training
thread and the integrations write per event: the hot path), :class:`trainer_hooks.emitter.Emitter`
(the thread that turns those rows into columns, beats and samples memory) and, on GPU,
:mod:`trainer_hooks.device_clock` (CUDA event pairs the emitter resolves later, so the training
thread never calls ``synchronize()``, ``.item()`` or ``elapsed_time()``; the CUDA path is written
to this rule and checked on CPU with :class:`~trainer_hooks.device_clock.HostClock`).

Accounting: see :mod:`trainer_hooks.recorder`. Bubble rate per stage and step (DESIGN §3):
``1 - (forward + backward) / duration`` (:func:`trainer_hooks.bubble.bubble_rate`).

No exception escapes a hook at run time: it is counted (``errors``), logged once per place, and
the training goes on. Setup errors (bad rank, bad run id, no endpoint) raise with a hint.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from tracetop import env as tenv
from tracetop.events import Kind
from trainer_hooks import closing, profiling, progress, shutdown
from trainer_hooks import commands as cmds
from trainer_hooks.device_clock import CudaClock, DeviceClock
from trainer_hooks.emitter import Emitter
from trainer_hooks.identity import Identity, SetupError, resolve
from trainer_hooks.integrations import collectives as colls
from trainer_hooks.integrations import ddp
from trainer_hooks.loss import loss_value
from trainer_hooks.memory import SKIPPED, StepPeak
from trainer_hooks.recorder import PhaseContext, Recorder

if TYPE_CHECKING:  # modules with protobuf: not loaded at import
    from tracetop.wire.shipper import Sink
    from tracetop.wire.transport import Transport

log = logging.getLogger("trainer_hooks")

_NAN = float("nan")


class _NullCtx:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> Literal[False]:
        return False


_NULL = _NullCtx()


class _StepCtx:
    __slots__ = ("t", "n", "tokens", "samples")

    def __init__(self, tracer: Tracer) -> None:
        self.t = tracer
        self.n = 0
        self.tokens = -1
        self.samples = -1

    def __enter__(self) -> None:
        t = self.t
        try:
            if not t._described:
                t.describe()
            commands = t.commands
            # before the step's clock starts; two reads a step where no boundary is wanted (the rest
            # of ``driving``, a seam, K = 0, a broken path, is boundary()'s to check)
            if commands is not None and (commands.handlers or commands.profile_alone):
                commands.boundary(self.n)
            t.recorder.begin_step(self.n)
        except Exception as e:
            t.recorder.hook_error("step", e)

    def __exit__(self, *exc: Any) -> Literal[False]:
        """The step's end: its row with the loss, batch shape and memory peak in force now (the
        peak reset for the next step), a profiling window's count, the progress record."""
        t = self.t
        rec = t.recorder
        try:
            loss = t._loss
            if type(loss) is not float:  # a tensor (read now; a device one copied, read by the emitter), None, an int
                try:
                    loss = loss_value(loss, deferred=rec.device_clock is not None)
                except Exception as e:
                    rec.hook_error("loss", e)
                    loss = _NAN
            t._loss = _NAN
            sp = t.step_peak  # a step that ends before the next read is due: SKIPPED, as take() would say
            peak = -1 if sp is None else SKIPPED if sp.clock_ns() < sp.next_ns else sp.take()
            rec.end_step(self.tokens, self.samples, loss, t.micro_batch, t.micro_batches, peak)
            windows = t.windows
            if windows is not None and windows.current is not None:  # a profiling window counts its steps
                windows.step_done()
            if t.progress is not None:
                t.progress.step_done(rec.step_n)
            if t._handover_s:
                now = time.monotonic()
                if now >= t._next_handover:
                    t._next_handover = now + t._handover_s
                    t.emitter.handover()  # type: ignore[union-attr]
        except Exception as e:
            rec.hook_error("step", e)
        return False


def _recorder_attr(name: str, doc: str) -> Any:
    """A Tracer attribute that lives on its Recorder (read and written there)."""

    def get(self: Tracer) -> Any:
        return getattr(self.recorder, name)

    def set_(self: Tracer, value: Any) -> None:
        setattr(self.recorder, name, value)

    return property(get, set_, doc=doc)


class Tracer:
    """Per-rank instrumentation of a training loop.

    ``with tracer.step(n): ...`` around each step, ``with tracer.phase("forward"): ...`` (``data``,
    ``forward``, ``backward``, ``optimizer``, or any name) inside it, ``tracer.close()`` at the end.
    Collectives are timed automatically (``wrap_collectives``; restored on close).

    Args (each: explicit argument, then the TRACETOP_* variable, then the default):
        endpoint: collector or agent address; TRACETOP_ENDPOINT.
        run_id: TRACETOP_RUN_ID, then the launcher's job id, then a timestamp agreed on by rank 0.
        rank, world_size, local_rank: from torchrun / the deepspeed launcher / Slurm variables.
        enabled: False (or TRACETOP_DISABLE=1) makes every method a no-op.
        transport / shipper: an in-memory transport (tests) or a ready sink (``tracetop.wire.shipper.Sink``).
        device: "cpu" (perf_counter) or "cuda" (CUDA events); default: cuda if torch sees one.
        heartbeat_s: TRACETOP_HEARTBEAT_S, default 5.
        memory_budget_bytes: declared budget reported beside the memory rows; TRACETOP_MEMORY_BUDGET_BYTES.
        flops_per_token / peak_flops / model_share: MFU inputs (model FLOPs per token for the
            whole model, the device's peak FLOP/s, this rank's share of the model: 1/(tp*pp)).
        tokens_per_step / samples_per_step: defaults for every step (per data-parallel replica).
        max_unacked_bytes: TRACETOP_BUFFER_BYTES; memory kept for telemetry while the endpoint is
            unreachable (beyond it the oldest batches are dropped and reported as gap rows).
        drain_interval_s: how often the emitter turns hot-path rows into columns, samples memory and
            ships them (default: the shipment interval, and at every heartbeat; each drain is a
            short burst holding the GIL). Rows wait here, not in the shipper: this is what sets how
            fresh the live view is.
        flush_interval_s: TRACETOP_FLUSH_S (tracetop/env.py DEFAULT_FLUSH_S): how often a rank's
            rows go out, one batch per kind (the shipper's own timer, and the drain's default).
        close_timeout_s: how long close() waits for the endpoint's acks.
        device_clock: the device timer (default: CUDA events when device="cuda"), a
            :class:`~trainer_hooks.device_clock.DeviceClock`.
        statm_path: where the emitter reads this process's resident set size.
    """

    errors = _recorder_attr("errors", "hook errors counted and skipped")
    current_phase = _recorder_attr("current_phase", "the phase the training thread is in")
    step_n = _recorder_attr("step_n", "the current (or last) step")
    in_step = _recorder_attr("in_step", "inside step()")
    pending_sig = _recorder_attr("pending_sig", "signature of the collective in progress, -1 if none")
    pending_t0 = _recorder_attr("pending_t0", "perf_counter ns at which it began")
    stage = _recorder_attr("stage", "this rank's pipeline stage (describe())")
    flops_per_token = _recorder_attr("flops_per_token", "model FLOPs per token (MFU input)")
    peak_flops = _recorder_attr("peak_flops", "the device's peak FLOP/s (MFU input)")
    model_share = _recorder_attr("model_share", "this rank's share of the model: 1/(tp*pp) (MFU input)")

    @property
    def events(self) -> int:
        """Rows recorded so far (for the benchmarks; ``Recorder.events``)."""
        return self.recorder.events

    def __init__(
        self,
        endpoint: str | None = None,
        run_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        local_rank: int | None = None,
        enabled: bool | None = None,
        transport: Transport | None = None,
        shipper: Sink | None = None,
        device: str | None = None,
        heartbeat_s: float | None = None,
        wrap_collectives: bool = True,
        memory_budget_bytes: int | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        model_share: float = 1.0,
        tokens_per_step: int | None = None,
        samples_per_step: int | None = None,
        max_unacked_bytes: int | None = None,
        close_timeout_s: float = 5.0,
        drain_interval_s: float | None = None,
        flush_interval_s: float | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        device_clock: DeviceClock | None = None,
        statm_path: str = "/proc/self/statm",
    ) -> None:
        self.enabled = (not tenv.disabled()) if enabled is None else bool(enabled)
        self.closed = False  # close() ran (or began)
        self.final_beat = False  # the exit path sent the closed heartbeat
        self._handover_s = 0.0  # local endpoints: seconds between handovers at step ends
        self.progress: progress.Progress | None = None  # the progress record (enabled tracers)
        self._next_handover = 0.0
        self.recorder = Recorder(clock_ns=clock_ns, flops_per_token=float(flops_per_token) if flops_per_token else _NAN,
                                 peak_flops=float(peak_flops) if peak_flops else _NAN, model_share=model_share)
        self._step_ctx = _StepCtx(self)
        self._switched: PhaseContext | None = None
        self._described = False
        self.identity: Identity | None = None
        self.tokens_per_step = tokens_per_step if tokens_per_step is not None else -1
        self.samples_per_step = samples_per_step if samples_per_step is not None else -1
        self.memory_budget_bytes = tenv.memory_budget_bytes(memory_budget_bytes)
        self.commands: cmds.CommandBus | None = None  # enabled tracers: commands at step boundaries
        self.windows: profiling.Windows | None = None  # enabled tracers: its profiling windows
        self.emitter: Emitter | None = None  # enabled tracers
        self.step_peak: StepPeak | None = None  # the step's memory peak (enabled tracers)
        # the batch shape in force, stamped on every STEP row (describe() sets it; -1 = unknown)
        self.micro_batch = -1
        self.micro_batches = -1
        self._loss: Any = _NAN  # the current step's loss, NaN until the trainer gives it
        self.close_timeout_s = close_timeout_s
        self.drain_interval_s = drain_interval_s
        self._wrapped: list[str] = []
        self.shipper: Sink
        if not self.enabled:
            from tracetop.wire.shipper import NullShipper

            self.shipper = NullShipper()
            self.rank = self.recorder.rank = rank if rank is not None else 0
            self.world_size = self.recorder.world_size = world_size if world_size is not None else 1
            self.run_id = "disabled"
            return

        # ---- setup: fail fast with a hint ----
        self.identity = ident = resolve(rank=rank, world_size=world_size, local_rank=local_rank, run_id=run_id)
        self.rank, self.world_size, self.local_rank = ident.rank, ident.world_size, ident.local_rank
        self.recorder.rank, self.recorder.world_size = ident.rank, ident.world_size
        self.run_id = _agree_run_id(ident, explicit=run_id)
        self.heartbeat_s = _seconds(heartbeat_s, tenv.TRACETOP_HEARTBEAT_S, tenv.DEFAULT_HEARTBEAT_S, "heartbeat")
        flush_interval_s = _seconds(flush_interval_s, tenv.TRACETOP_FLUSH_S, tenv.DEFAULT_FLUSH_S, "shipment")
        if drain_interval_s is None:  # rows reach the shipper as often as it ships them
            self.drain_interval_s = flush_interval_s
        if shipper is not None:
            self.shipper = shipper
        else:
            self.shipper = _make_shipper(self.run_id, self.rank, endpoint, transport, flush_interval_s,
                                         max_unacked_bytes)
        self.endpoint = getattr(self.shipper, "endpoint", None)
        # a unix-socket endpoint (the node agent): hand each finished step over (trainer_hooks/emitter.py)
        self._handover_s = _handover_s(self.endpoint)
        self.recorder.record = self.shipper.record
        # steps completed vs acked, read by a neighbour after a SIGKILL (progress.py); only for a
        # shipper made here to a real endpoint (an injected transport or sink is a test or a tool)
        if shipper is None and transport is None and hasattr(self.shipper, "on_acked"):
            self.progress = progress.Progress(self.run_id, self.rank, self.shipper.source_id)
            self.shipper.on_acked(self.progress.on_acked)
            progress.claim_dead(self.shipper, self.run_id)  # a predecessor of this run killed on this node
        own_clock = device_clock is None
        if device_clock is None:
            if device is None:
                device = _default_device()
            if device == "cuda":
                device_clock = CudaClock()
        self.recorder.device_clock = device_clock
        self.emitter = Emitter(self.recorder, self.shipper, heartbeat_s=self.heartbeat_s,
                               drain_interval_s=drain_interval_s, fallback_drain_s=flush_interval_s,
                               memory_budget_bytes=self.memory_budget_bytes, statm_path=statm_path)
        self.step_peak = StepPeak(_torch_cuda() if device_clock is not None and own_clock else None)
        self.commands = cmds.CommandBus(self)
        self.windows = self.commands.windows  # the step's end counts a running profiling window's steps
        if wrap_collectives:
            self._wrapped = self._install_collectives()
        self.emitter.start()
        shutdown.register(self)  # flush at SIGTERM/SIGINT and at exit, chained to the handlers there

    # ------------------------------------------------------------------ user API
    @property
    def device_clock(self) -> DeviceClock | None:
        """The device timer, None on the CPU clock."""
        return self.recorder.device_clock

    @property
    def pending(self) -> tuple[str, str, int]:
        """(op, role, wall clock ns it entered) of the collective this rank is inside, or ("", "", -1)."""
        return self.recorder.pending

    def step(self, n: int, *, tokens: int | None = None, samples: int | None = None) -> Any:
        """Context manager around one training step ``n``."""
        if not self.enabled:
            return _NULL
        ctx = self._step_ctx
        ctx.n = n
        ctx.tokens = self.tokens_per_step if tokens is None else tokens
        ctx.samples = self.samples_per_step if samples is None else samples
        return ctx

    def phase(self, name: str) -> Any:
        """Context manager around one phase of the current step (``data``, ``forward``,
        ``backward``, ``optimizer`` feed the STEP row; any other name shows in heartbeats)."""
        if not self.enabled:
            return _NULL
        return self.recorder.phase(name)

    def set_loss(self, value: Any) -> None:
        """The current step's loss (a float or a tensor; a CUDA tensor is read by the emitter once
        the step's end event is done, never synced here: trainer_hooks/loss.py). Only kept here:
        the value in force at the step's end is read then (``_StepCtx.__exit__``), so a tensor replaced
        before that (DeepSpeed's ``train_batch`` result, then the trainer's own float) is never read."""
        if self.enabled:
            self._loss = value

    def on_command(self, kind: str, fn: Callable[[Any], Any], current: Callable[[], Any] | None = None) -> None:
        """Apply ``kind`` (``micro_batch``: an int, ``offload``: a bool, ``rebalance``: a
        ``trainer_hooks.rebalance.Rebalance``) commands with ``fn(value)``,
        at a step boundary on every rank at the same step or on none (trainer_hooks/commands.py).
        Register the same kinds on every rank. ``fn`` raises to refuse; an undo calls ``fn`` with
        ``current()`` as read before applying."""
        if self.commands is not None:
            self.commands.on_command(kind, fn, current)

    def begin_step(self, n: int, *, tokens: int | None = None, samples: int | None = None) -> None:
        """For callback-style integrations: the same as entering ``step(n)``."""
        if self.enabled and not self.in_step:
            self.step(n, tokens=tokens, samples=samples).__enter__()

    def end_step(self) -> None:
        """Ends the step begun with :meth:`begin_step` (and a phase left open by :meth:`switch_phase`)."""
        if self.enabled and self.in_step:
            self.switch_phase(None)
            self._step_ctx.__exit__(None, None, None)

    def switch_phase(self, name: str | None) -> None:
        """For callback-style integrations: leave the phase entered by the last switch (if any) and
        enter ``name`` (None: enter nothing)."""
        if not self.enabled:
            return
        current = self._switched
        if current is not None:
            self._switched = None
            current.__exit__(None, None, None)
        if name:
            ctx = self.recorder.phase(name)
            ctx.__enter__()
            self._switched = ctx

    def describe(
        self,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        zero_stage: int = -1,
        stage: int = -1,
        model_name: str = "",
        n_params: int = -1,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        micro_batch: int = -1,
        micro_batches: int = -1,
        seq_len: int = -1,
        ds_config: dict | None = None,
        **extra: Any,
    ) -> None:
        """Record this rank's RUN_START row (once): its place in the topology and the model."""
        if not self.enabled or self._described:
            return
        rec = self.recorder
        try:
            self._described = True
            rec.stage = stage
            self.micro_batch, self.micro_batches = int(micro_batch), int(micro_batches)
            if flops_per_token:
                rec.flops_per_token = float(flops_per_token)
            if peak_flops:
                rec.peak_flops = float(peak_flops)
            dp = dp if dp is not None else max(1, self.world_size // max(1, tp * pp))
            meta = {"launcher": self.identity.launcher if self.identity else "", "local_rank": self.local_rank,
                    "device": "cuda" if rec.device_clock else "cpu", "collectives_wrapped": len(self._wrapped),
                    **extra}
            emitter = self.emitter
            assert emitter is not None
            rec.record(
                Kind.RUN_START, self.rank, -1, rec.clock_ns(), 0, self.world_size, tp, pp, dp, zero_stage, stage,
                model_name, int(n_params), rec.flops_per_token, rec.peak_flops, micro_batch, micro_batches,
                seq_len, emitter.hostname, emitter.pid, json.dumps(ds_config or {}, default=str),
                json.dumps(meta, default=str),
            )
        except Exception as e:
            rec.hook_error("describe", e)

    def set_topology(self, axes: dict[str, list[tuple[int, ...]]], coord_of: Callable[[int], dict[str, int]] | None = None,
                     axis_roles: dict[str, str] | None = None) -> None:
        """Name process groups by their rank sets: ``axes`` maps a role (``tp``, ``pp``, ``dp``,
        ``mp``) to the rank lists of its groups; ``coord_of(rank)`` gives a rank's coordinates for
        point-to-point roles, ``axis_roles`` maps a coordinate axis to a role."""
        self.recorder.set_topology(axes, coord_of, axis_roles)

    def record_offload(self, direction: str, what: str, nbytes: int, t0_ns: int, duration_ns: int) -> None:
        """One offload copy (``d2h``/``h2d``/``h2nvme``/``nvme2h``/``h2h``; ``grads``/``optim_state``/
        ``params``), timed by the caller with perf_counter_ns."""
        if not self.enabled:
            return
        rec = self.recorder
        try:
            rec.direct_events += 1
            rec.record(Kind.OFFLOAD, self.rank, rec.step_n, rec.wall(t0_ns), duration_ns, direction, what, nbytes)
        except Exception as e:
            rec.hook_error("offload", e)

    def close(self) -> None:
        """Restore the collectives, stop the emitter, flush (up to close_timeout_s). Idempotent. Not
        calling it loses nothing either: exit and SIGTERM/SIGINT flush too (shutdown.py)."""
        closing.close(self, None)

    def close_within(self, deadline: float) -> None:
        """close(), all of it bounded by ``deadline`` (monotonic): the interpreter's exit (shutdown.py)."""
        closing.close(self, deadline)

    def exit_flush(self, deadline: float, final: bool) -> None:
        """The process is ending on a signal (shutdown.py): ship what was recorded, acked by
        ``deadline`` (monotonic) or left (:func:`trainer_hooks.closing.exit_flush`). Never raises."""
        closing.exit_flush(self, deadline, final)

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        return {"errors": self.errors, "events": self.events, "shipper": self.shipper.stats()}

    def _install_collectives(self) -> list[str]:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            return []
        wrapped = colls.install(self.recorder)
        ddp.install(self.recorder)  # DDP's gradient buckets (its reducer bypasses the wrapper); FSDP groups named dp
        return wrapped


def _make_shipper(run_id: str, rank: int, endpoint: str | None, transport: Transport | None, flush_interval_s: float,
                  max_unacked_bytes: int | None) -> Sink:
    from tracetop.wire.shipper import Shipper

    # flush_rows: a shipment holds whatever the interval gathered (the 3 MiB cap still cuts it)
    kw: dict[str, Any] = {"flush_interval_s": flush_interval_s, "flush_rows": 1 << 16}
    if max_unacked_bytes is None:
        max_unacked_bytes = _buffer_bytes()
    if max_unacked_bytes is not None:
        kw["max_unacked_bytes"] = max_unacked_bytes
    target = None if transport is not None else trusted_endpoint(tenv.endpoint(endpoint), rank)
    if transport is None:
        kw.update(client_auth())  # TRACETOP_TOKEN_FILE / TRACETOP_TLS_*: a closed collector
    return Shipper(target, run_id=run_id, rank=rank, transport=transport, **kw)


def trusted_endpoint(endpoint: str, rank: int) -> str:
    """``endpoint``, or the collector when it is a unix socket another user could control (its
    folder, its listener's uid: tracetop/wire/local.py): the hooks then send it neither their token
    nor a report, and take no command from it. Said once, counted (``local.refused()``)."""
    from tracetop.wire import local

    target, reason = local.trusted(endpoint, tenv.collector())
    if reason is not None and local.refused() == 1:
        log.warning("trainer_hooks: rank %d does not trust %s and ships to %s instead: %s", rank, endpoint, target,
                    reason)
    return target


def _handover_s(endpoint: str | None) -> float:
    """Seconds between handovers at step ends: TRACETOP_HANDOVER_S for a unix-socket endpoint (the
    node agent's, or a collector on this host), else 0 (off: a remote collector gets a shipment
    every TRACETOP_FLUSH_S, each of which costs the rank ~2-4 ms of CPU)."""
    if not endpoint or not endpoint.startswith("unix:"):
        return 0.0
    raw = tenv.get(tenv.TRACETOP_HANDOVER_S)
    try:
        return max(0.0, float(raw)) if raw else tenv.DEFAULT_HANDOVER_S
    except ValueError as e:
        raise SetupError(f"trainer_hooks: {tenv.TRACETOP_HANDOVER_S}={raw!r} is not a number of seconds") from e


def _buffer_bytes() -> int | None:
    """TRACETOP_BUFFER_BYTES, None where unset or empty."""
    raw = tenv.get(tenv.TRACETOP_BUFFER_BYTES)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError as e:
        raise SetupError(f"trainer_hooks: {tenv.TRACETOP_BUFFER_BYTES}={raw!r} is not a number of bytes") from e


def client_auth() -> dict[str, Any]:
    """The shipper's credentials from TRACETOP_TOKEN_FILE / TRACETOP_TLS_CA (/_CERT/_KEY); a file
    that cannot be used fails the setup at once, naming it (never at run time)."""
    from tracetop.wire.auth import AuthSetupError, ClientAuth

    try:
        auth = ClientAuth.from_options()
    except AuthSetupError as e:
        raise SetupError(f"trainer_hooks: {e}") from None
    if auth.token is None and auth.tls_ca is None:
        return {}
    return {"channel_credentials": auth.channel_credentials(), "call_metadata": auth.metadata() or None,
            "channel_options": auth.channel_options() or None}


def _seconds(value: float | None, var: str, default: float, what: str) -> float:
    """A positive number of seconds: the argument, then the variable, then the default."""
    raw: float | str | None = value if value is not None else tenv.get(var, str(default))
    try:
        seconds = float(raw if raw is not None else default)
    except ValueError as e:
        raise SetupError(f"trainer_hooks: {what} interval {raw!r} is not a number; set {var} to seconds, e.g. {default:g}") from e
    if not seconds > 0:
        raise SetupError(f"trainer_hooks: {what} every {seconds} s; set {var} to a positive number of seconds")
    return seconds


def _torch_cuda() -> Any:
    import torch

    return torch.cuda


def _default_device() -> str:
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return "cuda"
    except Exception:
        pass
    return "cpu"


def _agree_run_id(ident: Identity, explicit: str | None) -> str:
    """When the run id was made up from a timestamp, take rank 0's so every rank agrees (one
    small broadcast at setup, before any collective is wrapped)."""
    import sys

    if explicit or os.environ.get(tenv.TRACETOP_RUN_ID) or os.environ.get("SLURM_JOB_ID") or ident.world_size == 1:
        return ident.run_id
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none"):
        return ident.run_id
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            box = [ident.run_id]
            dist.broadcast_object_list(box, src=0)
            return str(box[0])
    except Exception as e:
        log.warning("trainer_hooks: could not agree on a run id with rank 0 (%r); set %s", e, tenv.TRACETOP_RUN_ID)
    return ident.run_id


@contextmanager
def tracing(**kwargs: Any) -> Iterator[Tracer]:
    """``with trainer_hooks.tracing(...) as tracer:`` — a Tracer closed on the way out."""
    t = Tracer(**kwargs)
    try:
        yield t
    finally:
        t.close()
