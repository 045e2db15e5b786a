"""The Tracer: per-rank recorders for steps, phases, collectives, pipeline instructions, offload
copies, memory, throughput and heartbeats, shipped through one Shipper.

Hot path (the training thread): a clock read, a few integer additions and at most one tuple
appended to the shipper's buffer per event. No protobuf, no I/O, no device synchronization, no
logging per event, no lock but the shipper's append lock.

Timing: on CPU, ``time.perf_counter_ns``. On GPU (``device="cuda"``), a pair of CUDA events
recorded on the current stream; the emitter thread resolves them later (``query()`` then
``elapsed_time``) and does the same accounting in the same order, so the training thread never
calls ``synchronize()``, ``.item()`` or ``elapsed_time()``. (The CUDA path is written to this
rule but has not been run on a GPU.)

Accounting (per rank, per step; every figure in ns):

* a phase's time is its *self* time: wall time inside ``phase(name)`` minus the collective time
  inside it. ``forward_ns``/``backward_ns``/``optimizer_ns``/``data_wait_ns`` are sums of those.
* ``comm_exposed_ns`` is the time the training thread spent inside collectives (outermost calls;
  async calls count until they return). ``compute_ns = forward + backward + optimizer``.
  So ``duration ~ data_wait + compute + comm_exposed + untracked``.
* bubble rate per stage and step (DESIGN §3): ``1 - (forward + backward) / duration``
  (:func:`trainer_hooks.bubble.bubble_rate`).

No exception escapes a hook at run time: it is counted (``errors``), logged once per place, and
the training goes on. Setup errors (bad rank, bad run id, no endpoint) raise with a hint.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tracetop import env as tenv
from tracetop.events import Kind
from trainer_hooks import columns as cols
from trainer_hooks import commands as cmds
from trainer_hooks.identity import Identity, SetupError, resolve
from trainer_hooks.integrations import collectives as colls
from trainer_hooks.integrations import ddp
from trainer_hooks.loss import loss_value as _loss_value
from trainer_hooks.loss import resolve as _resolve_loss
from trainer_hooks.memory import StepPeak

log = logging.getLogger("trainer_hooks")

perf_counter_ns = time.perf_counter_ns
_STEP, _COLL, _INSTR, _OFFLOAD = Kind.STEP, Kind.COLLECTIVE, Kind.PIPE_INSTR, Kind.OFFLOAD
_MEMORY, _THROUGHPUT, _HEARTBEAT, _RUN_START = Kind.MEMORY, Kind.THROUGHPUT, Kind.HEARTBEAT, Kind.RUN_START

#: phase name -> accumulator slot. Other names are tracked for the heartbeat only.
PHASE_SLOTS = {"data": 0, "data_wait": 0, "forward": 1, "backward": 2, "optimizer": 3}
_N_SLOTS = 5  # 4 = anything else (comm instructions, user phases)
_NAN = float("nan")


class _NullCtx:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


_NULL = _NullCtx()


class _Acc:
    """Per-step accounting, fed with durations in the order events happened (by the training
    thread on CPU, by the emitter on GPU)."""

    __slots__ = ("comm_ns", "sums", "stack")

    def __init__(self) -> None:
        self.comm_ns = 0
        self.sums = [0] * _N_SLOTS
        self.stack: list[int] = []

    def reset(self) -> None:
        self.comm_ns = 0
        self.sums = [0] * _N_SLOTS
        self.stack.clear()


class _PhaseCtx:
    __slots__ = ("t", "name", "slot", "marks")

    def __init__(self, tracer: Tracer, name: str) -> None:
        self.t = tracer
        self.name = name
        self.slot = PHASE_SLOTS.get(name, 4)
        self.marks: list[tuple[Any, str]] = []

    def __enter__(self) -> None:
        t = self.t
        try:
            if t._cuda is None:
                acc = t._acc
                acc.stack.append(acc.comm_ns)
                self.marks.append((perf_counter_ns(), t.current_phase))
            else:
                t._deferred.append((0, None, None, None))  # "enter": snapshot comm time
                self.marks.append((t._cuda.mark(), t.current_phase))
            t.current_phase = self.name
        except Exception as e:
            t._hook_error("phase", e)

    def __exit__(self, *exc: Any) -> bool:
        t = self.t
        try:
            t0, prev = self.marks.pop()
            t.current_phase = prev
            if t._cuda is None:
                acc = t._acc
                acc.sums[self.slot] += perf_counter_ns() - t0 - (acc.comm_ns - acc.stack.pop())
            else:
                t._deferred.append((1, self.slot, t0, t._cuda.mark()))
        except Exception as e:
            t._hook_error("phase", e)
        return False


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
            t._step_begin(self.n)
        except Exception as e:
            t._hook_error("step", e)

    def __exit__(self, *exc: Any) -> bool:
        t = self.t
        try:
            t._step_end(self.tokens, self.samples)
        except Exception as e:
            t._hook_error("step", e)
        return False


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
        transport / shipper: an in-memory transport (tests) or a ready shipper.
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
        device_clock: the device timer (default: CUDA events when device="cuda"); any object with
            mark() / ready(ev) / elapsed_ns(a, b) / release(a, b) / memory(), see _CudaClock.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        run_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        local_rank: int | None = None,
        enabled: bool | None = None,
        transport: Any = None,
        shipper: Any = None,
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
        device_clock: Any = None,
    ) -> None:
        self.enabled = (not tenv.disabled()) if enabled is None else bool(enabled)
        self.errors = 0
        self._warned: set[str] = set()
        self._closed = False
        self.current_phase = "idle"
        self.pending_sig = -1  # index into _sig_list of the collective in progress, -1 if none
        self.pending_t0 = 0
        self.step_n = -1
        self.in_step = False
        self.events = 0  # rows recorded by the training thread (for the benchmark)
        self._clock_ns = clock_ns
        self._cuda: _CudaClock | None = None
        self._acc = _Acc()
        self._deferred: collections.deque = collections.deque()
        self._phases: dict[str, _PhaseCtx] = {}
        self._step_ctx = _StepCtx(self)
        self._switched: _PhaseCtx | None = None
        self._step_t0: Any = 0
        self._step_wall0 = 0
        self._step_perf0 = 0
        self._instr_counts: dict[str, int] = {}
        # hot-path buffers (plain lists; the emitter drains them into columns)
        self._rc: list[tuple] = []  # collectives: (step, start_ns, duration_ns, bytes, sig)
        self._ri: list[tuple] = []  # pipeline instructions: (step, start_ns, duration_ns, micro_batch, code)
        self._rs: list[tuple] = []  # one per step: columns.STEP_FIELDS
        self._sigs: dict[tuple, int] = {}
        self._sig_cache: dict[tuple, int] = {}
        self._sig_list: list[tuple] = []
        self._instr_codes: dict[str, int] = {}
        self._instr_names: list[str] = []
        self._drain_lock = threading.Lock()
        self._described = False
        self.stage = -1
        self.identity: Identity | None = None
        self.flops_per_token = float(flops_per_token) if flops_per_token else _NAN
        self.peak_flops = float(peak_flops) if peak_flops else _NAN
        self.model_share = model_share
        self.tokens_per_step = tokens_per_step if tokens_per_step is not None else -1
        self.samples_per_step = samples_per_step if samples_per_step is not None else -1
        self.memory_budget_bytes = tenv.memory_budget_bytes(memory_budget_bytes)
        self._commands: Any = None  # trainer_hooks.commands.CommandBus (enabled tracers)
        self._peak: Any = None  # trainer_hooks.memory.StepPeak: the step's memory peak
        # the batch shape in force, stamped on every STEP row (describe() sets it; -1 = unknown)
        self.micro_batch = -1
        self.micro_batches = -1
        self._loss = _NAN  # the current step's loss, NaN until the trainer gives it
        self.close_timeout_s = close_timeout_s
        self.drain_interval_s = drain_interval_s
        self._roles: dict[Any, tuple[str, int]] = {}
        self._peer_roles: dict[int, str] = {}
        self._axes: dict[str, list[tuple[int, ...]]] = {}
        self._axis_roles: dict[str, str] = {}
        self._coord_of: Callable[[int], dict[str, int]] | None = None
        self._hostname = socket.gethostname()
        self._pid = os.getpid()
        self._statm_fd = -1
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        if not self.enabled:
            from tracetop.wire.shipper import NullShipper

            self.shipper: Any = NullShipper()
            self.rank = rank if rank is not None else 0
            self.world_size = world_size if world_size is not None else 1
            self.run_id = "disabled"
            return

        # ---- setup: fail fast with a hint ----
        self.identity = ident = resolve(rank=rank, world_size=world_size, local_rank=local_rank, run_id=run_id)
        self.rank, self.world_size, self.local_rank = ident.rank, ident.world_size, ident.local_rank
        self.run_id = _agree_run_id(ident, explicit=run_id)
        self.heartbeat_s = _seconds(heartbeat_s, tenv.TRACETOP_HEARTBEAT_S, tenv.DEFAULT_HEARTBEAT_S, "heartbeat")
        flush_interval_s = _seconds(flush_interval_s, tenv.TRACETOP_FLUSH_S, tenv.DEFAULT_FLUSH_S, "shipment")
        self._drain_follows_shipper = drain_interval_s is None
        if drain_interval_s is None:  # rows reach the shipper as often as it ships them
            self.drain_interval_s = flush_interval_s
        if shipper is not None:
            self.shipper = shipper
        else:
            from tracetop.wire.shipper import Shipper

            # flush_rows: a shipment holds whatever the interval gathered (the 3 MiB cap still cuts it)
            kw: dict[str, Any] = {"flush_interval_s": flush_interval_s, "flush_rows": 1 << 16}
            if max_unacked_bytes is None and tenv.get(tenv.TRACETOP_BUFFER_BYTES):
                raw = tenv.get(tenv.TRACETOP_BUFFER_BYTES, "")
                try:
                    max_unacked_bytes = int(raw or "")
                except ValueError as e:
                    raise SetupError(f"trainer_hooks: {tenv.TRACETOP_BUFFER_BYTES}={raw!r} is not a number of bytes") from e
            if max_unacked_bytes is not None:
                kw["max_unacked_bytes"] = max_unacked_bytes
            target = None if transport is not None else tenv.endpoint(endpoint)
            if transport is None:
                kw.update(_client_auth())  # TRACETOP_TOKEN_FILE / TRACETOP_TLS_*: a closed collector
            self.shipper = Shipper(target, run_id=self.run_id, rank=self.rank, transport=transport, **kw)
        self.endpoint = getattr(self.shipper, "endpoint", None)
        self._record = self.shipper.record
        self._ship_soon = getattr(self.shipper, "ship_soon", lambda: None)
        if device_clock is not None:
            self._cuda = device_clock
        else:
            if device is None:
                device = _default_device()
            if device == "cuda":
                self._cuda = _CudaClock()
        try:
            self._statm_fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._statm_fd = -1
        self._peak = StepPeak(_torch_cuda() if self._cuda is not None and device_clock is None else None)
        self._commands = cmds.CommandBus(self)
        self._wrapped: list[str] = []
        if wrap_collectives:
            self._wrapped = self._install_collectives()
        self._stop = threading.Event()
        self._rewake = threading.Event()  # the emitter's sleep, cut short by close() or a new interval
        if self._drain_follows_shipper and hasattr(self.shipper, "on_interval_change"):
            self.shipper.on_interval_change(self._rewake.set)
        self._emitter = threading.Thread(target=self._run_emitter, name="tracetop-emitter", daemon=True)
        self._emitter.start()

    # ------------------------------------------------------------------ user API
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
        ctx = self._phases.get(name)
        if ctx is None:
            ctx = self._phases[name] = _PhaseCtx(self, name)
        return ctx

    def set_loss(self, value: Any) -> None:
        """The current step's loss (a float or a tensor; a CUDA tensor is read by the emitter once
        the step's end event is done, never synced here: trainer_hooks/loss.py)."""
        if self.enabled:
            try:
                self._loss = _loss_value(value, deferred=self._cuda is not None)
            except Exception as e:
                self._hook_error("loss", e)

    def on_command(self, kind: str, fn: Callable[[Any], Any], current: Callable[[], Any] | None = None) -> None:
        """Apply ``kind`` (``micro_batch``: an int, ``offload``: a bool) commands with ``fn(value)``,
        at a step boundary on every rank at the same step or on none (trainer_hooks/commands.py).
        Register the same kinds on every rank. ``fn`` raises to refuse; an undo calls ``fn`` with
        ``current()`` as read before applying."""
        if self._commands is not None:
            self._commands.on_command(kind, fn, current)

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
            ctx = self.phase(name)
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
        try:
            self._described = True
            self.stage = stage
            self.micro_batch, self.micro_batches = int(micro_batch), int(micro_batches)
            if flops_per_token:
                self.flops_per_token = float(flops_per_token)
            if peak_flops:
                self.peak_flops = float(peak_flops)
            dp = dp if dp is not None else max(1, self.world_size // max(1, tp * pp))
            meta = {"launcher": self.identity.launcher if self.identity else "", "local_rank": self.local_rank,
                    "device": "cuda" if self._cuda else "cpu", "collectives_wrapped": len(self._wrapped), **extra}
            self._record(
                _RUN_START, self.rank, -1, self._clock_ns(), 0, self.world_size, tp, pp, dp, zero_stage, stage,
                model_name, int(n_params), self.flops_per_token, self.peak_flops, micro_batch, micro_batches,
                seq_len, self._hostname, self._pid, json.dumps(ds_config or {}, default=str),
                json.dumps(meta, default=str),
            )
        except Exception as e:
            self._hook_error("describe", e)

    def set_topology(self, axes: dict[str, list[tuple[int, ...]]], coord_of: Callable[[int], dict[str, int]] | None = None,
                     axis_roles: dict[str, str] | None = None) -> None:
        """Name process groups by their rank sets: ``axes`` maps a role (``tp``, ``pp``, ``dp``,
        ``mp``) to the rank lists of its groups; ``coord_of(rank)`` gives a rank's coordinates for
        point-to-point roles, ``axis_roles`` maps a coordinate axis to a role."""
        self._axes = {role: [tuple(sorted(r)) for r in lists] for role, lists in axes.items()}
        self._coord_of = coord_of
        self._axis_roles = dict(axis_roles or {})
        self._roles.clear()
        self._peer_roles.clear()
        self._sig_cache.clear()

    def record_offload(self, direction: str, what: str, nbytes: int, t0_ns: int, duration_ns: int) -> None:
        """One offload copy (``d2h``/``h2d``/``h2nvme``/``nvme2h``/``h2h``; ``grads``/``optim_state``/
        ``params``), timed by the caller with perf_counter_ns."""
        if not self.enabled:
            return
        try:
            self.events += 1
            self._record(_OFFLOAD, self.rank, self.step_n, self._wall(t0_ns), duration_ns, direction, what, nbytes)
        except Exception as e:
            self._hook_error("offload", e)

    def close(self) -> None:
        """Restore the collectives, stop the emitter, flush (up to close_timeout_s). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        try:
            colls.uninstall(self)
            ddp.uninstall(self)
            self._commands.close()
            self._stop.set()
            self._rewake.set()
            self._emitter.join(timeout=max(2.0, self.close_timeout_s))
            self._heartbeat(closed=True)  # the clean close: collector/source_ends.py watches for it
        except Exception as e:
            self._hook_error("close", e)
        finally:
            timeout_s = self.close_timeout_s
            st = self.shipper.stats()
            if st and st.get("last_error") and not st.get("connected") and not st.get("batches_acked"):
                # never reached the endpoint: do not hold the trainer's exit for long
                timeout_s = min(timeout_s, 1.0)
                log.warning("trainer_hooks: rank %d never reached %s; %d telemetry batches are dropped at exit",
                            self.rank, self.endpoint, st.get("unacked_batches", 0))
            self.shipper.close(timeout_s)
            if self._statm_fd >= 0:
                os.close(self._statm_fd)
                self._statm_fd = -1
            self._peak.close()
            if self.errors:
                log.warning("trainer_hooks: %d hook errors were counted and skipped on rank %d", self.errors, self.rank)

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        return {"errors": self.errors, "events": self.events, "shipper": self.shipper.stats()}

    # ------------------------------------------------------------------ steps
    def _wall(self, perf_ns: int) -> int:
        return self._step_wall0 + (perf_ns - self._step_perf0)

    def _step_begin(self, n: int) -> None:
        if not self._described:
            self.describe()
        if self._commands.driving:  # before the step's clock starts
            self._commands.boundary(n)
        self.step_n = n
        self.in_step = True
        self._instr_counts.clear()
        self._step_wall0 = self._clock_ns()
        self._step_perf0 = perf_counter_ns()
        if self._cuda is None:
            self._acc.reset()
            self._step_t0 = self._step_perf0
        else:
            self._deferred.append((3, n, None, None))  # "step begins": reset the accumulator
            self._step_t0 = self._cuda.mark()

    def _step_end(self, tokens: int, samples: int) -> None:
        self.in_step = False
        self.current_phase = "idle"
        # as in force at this step's end, and the step's memory peak (reset for the next step)
        shape = (self._loss, self.micro_batch, self.micro_batches, self._peak.take())
        self._loss = _NAN
        if self._cuda is None:
            dur = perf_counter_ns() - self._step_t0
            self._finish_step(self.step_n, self._step_wall0, dur, tokens, samples, self._acc, shape)
        else:
            info = (self.step_n, self._step_wall0, tokens, samples, shape)
            self._deferred.append((4, info, self._step_t0, self._cuda.mark()))

    def _finish_step(self, n: int, wall0: int, dur: int, tokens: int, samples: int, acc: _Acc,
                     shape: tuple[float, int, int, int]) -> None:
        s = acc.sums
        if not isinstance(shape[0], float):  # a device loss: its copy is done (GPU path: the emitter, event ready)
            shape = (_resolve_loss(shape[0]), *shape[1:])  # (loss, micro_batch, micro_batches, step peak)
        secs = dur / 1e9 if dur > 0 else _NAN
        tps = tokens / secs if tokens >= 0 else _NAN
        sps = samples / secs if samples >= 0 else _NAN
        tflops = tps * self.flops_per_token * self.model_share / 1e12
        # memory is sampled by the emitter when it ships these rows (at most drain_interval_s later)
        self._rs.append((n, wall0, dur, s[0], s[1], s[2], s[3], acc.comm_ns, s[1] + s[2] + s[3], tokens, samples,
                         tps, sps, tflops, tflops * 1e12 / self.peak_flops, *shape))
        self.events += 3

    def _memory(self) -> tuple[int, int, int, int]:
        rss = -1
        if self._statm_fd >= 0:
            rss = int(os.pread(self._statm_fd, 64, 0).split()[1]) * self._page
        if self._cuda is not None:
            alloc, reserved, peak = self._cuda.memory()
        else:
            alloc = reserved = -1
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return alloc, reserved, peak, rss

    # ------------------------------------------------------------------ pipeline instructions
    def _instr_enter(self, instr: str, slot: int) -> tuple[Any, int, str]:
        """GPU path (the CPU path is inlined in trainer_hooks.integrations.pipeline)."""
        counts = self._instr_counts
        mb = counts.get(instr, 0)
        counts[instr] = mb + 1
        prev = self.current_phase
        self.current_phase = _INSTR_PHASE.get(instr, "comm")
        self._deferred.append((0, None, None, None))
        return self._cuda.mark(), mb, prev  # type: ignore[union-attr]

    def _instr_exit(self, instr: str, slot: int, token: tuple[Any, int, str], has_mb: bool) -> None:
        t0, mb, prev = token
        self.current_phase = prev
        row = (slot, self.step_n, self._wall(perf_counter_ns()), mb if has_mb else -1, instr)
        self._deferred.append((2, row, t0, self._cuda.mark()))  # type: ignore[union-attr]

    # ------------------------------------------------------------------ collectives
    def _install_collectives(self) -> list[str]:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            return []
        wrapped = colls.install(self)
        ddp.install(self)  # DDP's gradient buckets (its reducer bypasses the wrapper); FSDP groups named dp
        return wrapped

    def _group_info(self, group: Any) -> tuple[str, int]:
        info = self._roles.get(group)
        if info is None:
            import torch.distributed.distributed_c10d as c10d

            try:
                pg = group if group is not None else c10d._get_default_group()
                ranks = tuple(c10d.get_process_group_ranks(pg))
            except Exception:
                ranks = tuple(range(self.world_size))
            info = (colls.classify_ranks(ranks, self._axes, self.world_size), len(ranks))
            self._roles[group] = info
        return info

    def _peer_role(self, peer: int) -> str:
        role = self._peer_roles.get(peer)
        if role is None:
            role = self._peer_roles[peer] = colls.peer_role(self._coord_of, self.rank, peer, self._axis_roles)
        return role

    def _collective_enter(self, spec: Any, args: tuple, kwargs: dict) -> tuple:
        """GPU path: name the call and record the start event."""
        sig, nbytes = self._collective_sig(spec, args, kwargs)
        self.pending_sig = sig
        t0 = self.pending_t0 = perf_counter_ns()
        return (sig, nbytes, t0, self._cuda.mark())  # type: ignore[union-attr]

    def _collective_sig(self, spec: Any, args: tuple, kwargs: dict) -> tuple[int, int]:
        """(signature index, bytes) of one collective call; the signature is looked up once per
        (op, group, dtype, async, peer) and holds its op, role, group size, peer, dtype, async."""
        n = len(args)
        if spec.kind == "arg":  # one tensor: the common case, inlined
            tensor = args[spec.index] if spec.index < n else kwargs.get(spec.arg_name)
            nbytes = tensor.nbytes if tensor is not None else 0
        else:
            nbytes, tensor = colls.payload(spec, args, kwargs)
        gi, ai, pi = spec.group_i, spec.async_i, spec.peer_i
        if kwargs:
            group = kwargs["group"] if "group" in kwargs else (args[gi] if 0 <= gi < n else None)
            is_async = kwargs["async_op"] if "async_op" in kwargs else (args[ai] if 0 <= ai < n else False)
            peer = kwargs[spec.peer_name] if spec.peer_name in kwargs else (args[pi] if 0 <= pi < n else None)
            if peer is None and spec.group_peer_name in kwargs and group is not None:
                import torch.distributed as dist

                peer = dist.get_global_rank(group, kwargs[spec.group_peer_name])
        else:
            group = args[gi] if 0 <= gi < n else None
            is_async = args[ai] if 0 <= ai < n else False
            peer = args[pi] if 0 <= pi < n else None
        key = (spec, group, tensor.dtype if tensor is not None else None, bool(is_async), peer)
        sig = self._sig_cache.get(key)
        if sig is None:
            sig = self._new_sig(spec, group, tensor, bool(is_async), peer, key)
        return sig, nbytes

    def _new_sig(self, spec: Any, group: Any, tensor: Any, is_async: bool, peer: Any, key: tuple) -> int:
        """First call of its kind: name the group, the peer and the dtype once."""
        role, size = self._group_info(group)
        if role in ("world", "group") and getattr(spec, "default_role", ""):
            role = spec.default_role  # DDP's buckets and broadcasts are data parallel whatever the group
        peer_rank = -1
        if spec.peer_name and peer is not None:
            peer_rank = int(peer)
            role, size = self._peer_role(peer_rank), 2
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else ""
        asynchronous = 1 if (is_async or spec.name in colls.ALWAYS_ASYNC) else 0
        full = (spec.name, role, size, peer_rank, dtype, asynchronous)
        sig = self._sigs.get(full)
        if sig is None:
            sig = self._sigs[full] = len(self._sig_list)
            self._sig_list.append(full)
        self._sig_cache[key] = sig
        return sig

    def _collective_exit(self, token: tuple) -> None:
        """GPU path: record the end event; the emitter does the accounting."""
        self.pending_sig = -1
        sig, nbytes, t0, ev0 = token
        self._deferred.append((5, (self.step_n, self._wall(t0), nbytes, sig), ev0, self._cuda.mark()))  # type: ignore[union-attr]
        self.events += 1

    @property
    def pending(self) -> tuple[str, str, int]:
        """(op, role, wall clock ns it entered) of the collective this rank is inside, or ("", "", -1)."""
        sig, t0 = self.pending_sig, self.pending_t0
        if sig < 0:
            return "", "", -1
        op, role = self._sig_list[sig][:2]
        return op, role, self._wall(t0)

    # ------------------------------------------------------------------ emitter thread
    def _run_emitter(self) -> None:
        # GPU: resolve CUDA events every 50 ms (they are few and must be released); CPU: wake only
        # to drain or beat. Each wake-up takes the GIL from training: few, large pieces of work.
        next_hb = time.monotonic() + self.heartbeat_s
        next_drain = time.monotonic() + self.drain_interval_s

        def wait() -> float:
            due = max(0.0, min(next_hb, next_drain) - time.monotonic())
            return min(0.05, due) if self._cuda is not None else due

        last_drain = time.monotonic()
        while True:
            if self._rewake.wait(wait()):
                self._rewake.clear()
                # a new interval (the collector asks for fresh rows while the run is watched)
                next_drain = min(next_drain, last_drain + self._drain_every())
            if self._stop.is_set():
                break
            try:
                if self._cuda is not None:
                    self._resolve_deferred()
                now = time.monotonic()
                if now >= next_drain or now >= next_hb:
                    last_drain, next_drain = now, now + self._drain_every()
                    drained = self._drain()
                    beat = now >= next_hb
                    if beat:
                        next_hb = now + self.heartbeat_s
                        self._heartbeat()
                    if drained or beat:
                        # out now, one shipment with everything drained (and the heartbeat): a
                        # row waits at most one drain interval, not a drain and then a flush
                        self._ship_soon()
            except Exception as e:  # the emitter never dies
                self._hook_error("emitter", e)
        if self._cuda is not None:
            deadline = time.monotonic() + 2.0
            while self._deferred and time.monotonic() < deadline:
                self._resolve_deferred()
                time.sleep(0.01)
        try:
            self._drain()
        except Exception as e:
            self._hook_error("emitter", e)

    def _drain_every(self) -> float:
        """The drain interval: the shipper's interval now (shorter while the collector asks for
        fresh rows because someone watches the run), unless one was given."""
        if self._drain_follows_shipper:
            return float(getattr(self.shipper, "ship_interval_s", self.drain_interval_s))
        return self.drain_interval_s

    def _instr_code(self, instr: str) -> int:
        code = self._instr_codes.get(instr)
        if code is None:
            self._instr_names.append(instr)
            code = self._instr_codes[instr] = len(self._instr_names) - 1
        return code

    @staticmethod
    def _take(buf: list) -> list:
        """Everything appended so far (appends only ever add at the end; slicing and deleting a
        prefix are single operations under the GIL, so nothing is lost or taken twice)."""
        n = len(buf)
        chunk = buf[:n]
        del buf[:n]
        return chunk

    def _drain(self) -> bool:
        """Emitter: hot-path rows -> columns -> the shipper, a few vectorised operations per kind.
        True when there were rows."""
        drained = False
        with self._drain_lock:
            rows = self._take(self._rc)
            if rows:
                drained = True
                self.shipper.record_many(_COLL, cols.collective_columns(self.rank, rows, list(self._sig_list)))
            rows = self._take(self._ri)
            if rows:
                drained = True
                self.shipper.record_many(_INSTR, cols.instr_columns(self.rank, self.stage, rows, list(self._instr_names)))
            rows = self._take(self._rs)
            if rows:
                a, res, peak, rss = self._memory()  # r[-1]: the step's own peak, where measured
                step, throughput, memory = cols.step_columns(
                    self.rank, [r[:-1] + (a, res, r[-1] if r[-1] >= 0 else peak, rss, self.memory_budget_bytes) for r in rows])
                self.shipper.record_many(_STEP, step)
                self.shipper.record_many(_THROUGHPUT, throughput)
                self.shipper.record_many(_MEMORY, memory)
                drained = True
        return drained

    def _heartbeat(self, closed: bool = False) -> None:
        op, role, since = self.pending
        phase = "closed" if closed else "comm" if op else (self.current_phase if self.in_step else "idle")
        self._record(_HEARTBEAT, self.rank, self.step_n, self._clock_ns(), 0, phase, op, role, since,
                     self._hostname, self._pid)

    def _resolve_deferred(self) -> None:
        """GPU: turn resolved CUDA event pairs into durations, in recording order."""
        cuda = self._cuda
        assert cuda is not None
        acc = self._gpu_acc if hasattr(self, "_gpu_acc") else None
        if acc is None:
            acc = self._gpu_acc = _Acc()
        q = self._deferred
        while q:
            op, payload, a, b = q[0]
            if b is not None and not cuda.ready(b):
                return
            if op == ddp.OP_PASS and not ddp.pass_ready(cuda, payload, a):
                return
            q.popleft()
            if op == ddp.OP_PASS:  # one DDP backward pass: its bucket rows and exposed wait
                ddp.resolve_pass(self, acc, cuda, payload, a)
                continue
            if op == 0:
                acc.stack.append(acc.comm_ns)
                continue
            if op == 3:
                acc.reset()
                continue
            dur = cuda.elapsed_ns(a, b)
            if op == 1:
                acc.sums[payload] += dur - (acc.comm_ns - acc.stack.pop())
            elif op == 2:
                slot, step, wall, mb, instr = payload
                acc.sums[slot] += dur - (acc.comm_ns - acc.stack.pop())
                self._ri.append((step, wall, dur, mb, self._instr_codes.get(instr) or self._instr_code(instr)))
            elif op == 5:
                step, wall, nbytes, sig = payload
                acc.comm_ns += dur
                self._rc.append((step, wall, dur, nbytes, sig))
            elif op == 4:
                n, wall0, tokens, samples, shape = payload
                self._finish_step(n, wall0, dur, tokens, samples, acc, shape)
            cuda.release(a, b)

    def _hook_error(self, where: str, e: BaseException) -> None:
        self.errors += 1
        if where not in self._warned:
            self._warned.add(where)
            log.warning("trainer_hooks: %s hook failed on rank %s (counted, training goes on): %r",
                        where, getattr(self, "rank", "?"), e)


#: pipeline instruction -> (accumulator slot, heartbeat phase, has a micro-batch)
INSTRUCTIONS: dict[str, tuple[int, str, bool]] = {
    "LoadMicroBatch": (0, "data", True),
    "ForwardPass": (1, "forward", True),
    "BackwardPass": (2, "backward", True),
    "OptimizerStep": (3, "optimizer", False),
    "SendActivation": (4, "comm", True),
    "RecvActivation": (4, "comm", True),
    "SendGrad": (4, "comm", True),
    "RecvGrad": (4, "comm", True),
    "ReduceGrads": (4, "comm", False),
    "ReduceTiedGrads": (4, "comm", False),
}
_INSTR_PHASE = {k: v[1] for k, v in INSTRUCTIONS.items()}


def _client_auth() -> dict[str, Any]:
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
    raw = value if value is not None else tenv.get(var, str(default))
    try:
        seconds = float(raw)  # type: ignore[arg-type]
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


class _CudaClock:
    """CUDA events from a pool, recorded on the current stream; resolved by the emitter only."""

    def __init__(self, event: Any = None) -> None:
        import torch

        self._torch = torch
        self._event = event if event is not None else torch.cuda.Event  # a test's fake: torch.cuda.Event's API
        self._pool: list[Any] = []

    def mark(self) -> Any:
        try:  # marks come from several threads (training, autograd, a process group's): pop, not test-then-pop
            ev = self._pool.pop()
        except IndexError:
            ev = self._event(enable_timing=True)
        ev.record()
        return ev

    def ready(self, ev: Any) -> bool:
        return bool(ev.query())

    def elapsed_ns(self, a: Any, b: Any) -> int:
        return int(a.elapsed_time(b) * 1e6)

    def release(self, a: Any, b: Any) -> None:
        if len(self._pool) < 4096:
            self._pool.append(a)
            self._pool.append(b)

    def memory(self) -> tuple[int, int, int]:
        c = self._torch.cuda
        return c.memory_allocated(), c.memory_reserved(), c.max_memory_allocated()


@contextmanager
def tracing(**kwargs: Any) -> Iterator[Tracer]:
    """``with trainer_hooks.tracing(...) as tracer:`` — a Tracer closed on the way out."""
    t = Tracer(**kwargs)
    try:
        yield t
    finally:
        t.close()
