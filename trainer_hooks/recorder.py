"""The recording surface: what the training thread (and the integrations' hooks) write per event.

One :class:`Recorder` per Tracer holds the step clock, the current phase, the collective in
progress (``pending``), the step's accumulator and three row buffers the emitter drains:
``collective_rows``, ``instr_rows`` and ``step_rows``. The integrations
(:mod:`trainer_hooks.integrations`) are handed the Recorder and use only the names defined here.

Hot path: a clock read, a few integer additions and at most one row's numbers extended onto a list
per event. No
protobuf, no I/O, no device synchronization, no logging per event, no lock.

Accounting (per rank, per step; every figure in ns):

* a phase's time is its *self* time: wall time inside ``phase(name)`` minus the collective time
  inside it. ``forward_ns``/``backward_ns``/``optimizer_ns``/``data_wait_ns`` are sums of those.
* ``comm_exposed_ns`` is the time the training thread spent inside collectives (outermost calls;
  async calls count until they return). ``compute_ns = forward + backward + optimizer``.
  So ``duration ~ data_wait + compute + comm_exposed + untracked``.

On the device clock (GPU) the same events go to ``deferred`` as event pairs
(:mod:`trainer_hooks.device_clock`); the emitter does this accounting later, in the same order.

No exception escapes a hook at run time: it goes to :meth:`Recorder.hook_error` (counted, logged
once per place) and the training goes on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from tracetop.events import Kind
from trainer_hooks.columns import ROW_WIDTH
from trainer_hooks.device_clock import DeferredOp, DeviceClock
from trainer_hooks.integrations import collectives as colls
from trainer_hooks.loss import resolve as resolve_loss

log = logging.getLogger("trainer_hooks")

perf_counter_ns = time.perf_counter_ns
_NAN = float("nan")
_ENTER, _PHASE, _INSTR = DeferredOp.ENTER, DeferredOp.PHASE, DeferredOp.INSTR
_STEP_BEGIN, _STEP_END, _COLLECTIVE = DeferredOp.STEP_BEGIN, DeferredOp.STEP_END, DeferredOp.COLLECTIVE

#: phase name -> accumulator slot. Other names are tracked for the heartbeat only.
PHASE_SLOTS = {"data": 0, "data_wait": 0, "forward": 1, "backward": 2, "optimizer": 3}
N_SLOTS = 5  # 4 = anything else (comm instructions, user phases)
_ZEROS = (0,) * N_SLOTS

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


def _discard(kind: Kind, *row: Any) -> None:
    return None


def _mfu_input(i: int, doc: str) -> Any:
    """A Recorder attribute kept in ``mfu_table[mfu_index]`` (read there; a change appends a new
    entry, so rows already recorded keep the inputs that were in force)."""

    def get(self: Recorder) -> float:
        return self.mfu_table[self.mfu_index][i]

    def set_(self: Recorder, value: float) -> None:
        inputs = list(self.mfu_table[self.mfu_index])
        inputs[i] = value
        self.mfu_table.append((inputs[0], inputs[1], inputs[2]))
        self.mfu_index = len(self.mfu_table) - 1

    return property(get, set_, doc=doc)


class StepAccumulator:
    """Per-step accounting, fed with durations in the order events happened (by the training
    thread on CPU, by the emitter on GPU): ``sums`` per slot (:data:`PHASE_SLOTS`), ``comm_ns``,
    and a stack of the comm time at each open phase's entry."""

    __slots__ = ("comm_ns", "sums", "stack")

    def __init__(self) -> None:
        self.comm_ns = 0
        self.sums = [0] * N_SLOTS
        self.stack: list[int] = []

    def reset(self) -> None:
        self.comm_ns = 0
        self.sums[:] = _ZEROS  # in place: nothing allocated (finish_step copies the sums into its row)
        self.stack.clear()


class PhaseContext:
    """``with recorder.phase(name):`` — one phase's self time into its slot."""

    __slots__ = ("rec", "name", "slot", "marks")

    def __init__(self, rec: Recorder, name: str) -> None:
        self.rec = rec
        self.name = name
        self.slot = PHASE_SLOTS.get(name, 4)
        self.marks: list[tuple[Any, str]] = []

    def __enter__(self) -> None:
        r = self.rec
        try:
            clock = r.device_clock
            if clock is None:
                acc = r.acc
                acc.stack.append(acc.comm_ns)
                self.marks.append((perf_counter_ns(), r.current_phase))
            else:
                r.deferred.append((_ENTER, None, None, None))  # snapshot comm time
                self.marks.append((clock.mark(), r.current_phase))
            r.current_phase = self.name
        except Exception as e:
            r.hook_error("phase", e)

    def __exit__(self, *exc: Any) -> Literal[False]:
        r = self.rec
        try:
            t0, prev = self.marks.pop()
            r.current_phase = prev
            clock = r.device_clock
            if clock is None:
                acc = r.acc
                acc.sums[self.slot] += perf_counter_ns() - t0 - (acc.comm_ns - acc.stack.pop())
            else:
                r.deferred.append((_PHASE, self.slot, t0, clock.mark()))
        except Exception as e:
            r.hook_error("phase", e)
        return False


class Recorder:
    """One rank's recording state and the methods the hooks call.

    ``device_clock``: None on CPU (``perf_counter_ns``), else the device timer whose event pairs go
    to ``deferred``. ``record``: the one-row intake of the sink (``Shipper.record``), for rows that
    are not buffered here (offload copies, heartbeats, RUN_START). ``clock_ns``: wall clock.
    ``flops_per_token`` / ``peak_flops`` / ``model_share``: the MFU inputs of each STEP row.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, *, device_clock: DeviceClock | None = None,
                 record: Callable[..., None] = _discard, clock_ns: Callable[[], int] = time.time_ns,
                 flops_per_token: float = _NAN, peak_flops: float = _NAN, model_share: float = 1.0) -> None:
        self.rank, self.world_size = rank, world_size
        self.device_clock = device_clock
        self.record = record
        self.clock_ns = clock_ns
        #: every (flops_per_token, model_share, peak_flops) set so far, and the index of the one in force:
        #: a STEP row carries the index (an int: a row of numbers only is one the garbage collector
        #: stops tracking), the emitter derives throughput and MFU from it, vectorised
        self.mfu_table: list[tuple[float, float, float]] = [(flops_per_token, model_share, peak_flops)]
        self.mfu_index = 0
        self.stage = -1  # this rank's pipeline stage (describe())
        self.errors = 0
        self.warned: set[str] = set()
        # the row count (``events``, for the benchmarks) is read off the buffers, not counted per
        # event on the hot path: rows the emitter took (``rows_taken``, under ``drain_lock``, which a
        # count takes too: no row is seen twice or missed in flight), rows still in the buffers, and
        # rows sent straight to the sink (``direct_events``: offload copies)
        self.direct_events = 0
        self.rows_taken = 0
        self.drain_lock = threading.Lock()
        self.current_phase = "idle"
        self.pending_sig = -1  # index into signature_table of the collective in progress, -1 if none
        self.pending_t0 = 0  # perf_counter_ns at its entry
        # the step clock: wall ns and perf_counter ns at the step's start (rows' start = wall0 + perf delta)
        self.step_n = -1
        self.in_step = False
        self.step_wall0 = 0
        self.step_perf0 = 0
        self.step_off = 0  # step_wall0 - step_perf0: a perf_counter_ns reading + step_off = its wall ns
        self.step_t0: Any = 0  # perf_counter ns, or the start event on the device clock
        self.acc = StepAccumulator()
        self.deferred: collections.deque[tuple[DeferredOp, Any, Any, Any]] = collections.deque()
        # row buffers (plain lists; the emitter drains them into columns). Collective and instruction
        # rows are flat: each row's 5 numbers extended onto the list (``rows.extend((a, b, c, d, e))``,
        # one step under the GIL, so a drain never sees part of a row), no tuple kept per row: a kept
        # tuple is one more object the garbage collector's young generation walks and counts
        self.collective_rows: list[int] = []  # step, start_ns, duration_ns, bytes, sig; ... (ROW_WIDTH a row)
        self.instr_rows: list[int] = []  # step, start_ns, duration_ns, micro_batch, instr code; ...
        self.step_rows: list[tuple] = []  # one per step: columns.STEP_ROW (the emitter derives the rest)
        #: instr code -> how many this step (its micro-batch index): a list, so the wrapper's count is
        #: two list subscripts, not a dict method call; one entry per code, added by ``instr_code``
        #: only (at wrap time), reset in place by ``begin_step``
        self.instr_counts: list[int] = []
        self._counts_zero: tuple[int, ...] = ()
        self.instr_names: list[str] = []  # instr code -> name
        self._instr_codes: dict[str, int] = {}
        #: signature index -> (op, role, group size, peer rank, dtype, async)
        self.signature_table: list[tuple] = []
        self._sigs: dict[tuple, int] = {}
        self._sig_cache: dict[tuple, int] = {}  # (spec, group, dtype, async, peer) -> signature
        #: spec -> dtype -> signature of a call whose one argument is its tensor (integrations.collectives)
        self.fast_sigs: dict[Any, dict[Any, int]] = {}
        self.axes: dict[str, list[tuple[int, ...]]] = {}  # role -> rank sets of its groups
        self._axis_roles: dict[str, str] = {}
        self._coord_of: Callable[[int], dict[str, int]] | None = None
        self._roles: dict[Any, tuple[str, int]] = {}
        self._peer_roles: dict[int, str] = {}
        self.no_future: set[int] = set()  # signatures whose async Work has no future (async_done)
        self._phases: dict[str, PhaseContext] = {}

    @property
    def events(self) -> int:
        """Rows recorded so far (a STEP row counts 3: its THROUGHPUT and MEMORY rows): the
        benchmarks' denominator. A device-clock row counts once the emitter has resolved it."""
        with self.drain_lock:
            return (self.direct_events + self.rows_taken + len(self.collective_rows) // ROW_WIDTH
                    + len(self.instr_rows) // ROW_WIDTH + 3 * len(self.step_rows))

    flops_per_token = _mfu_input(0, "model FLOPs per token (MFU input)")
    model_share = _mfu_input(1, "this rank's share of the model: 1/(tp*pp) (MFU input)")
    peak_flops = _mfu_input(2, "the device's peak FLOP/s (MFU input)")

    # ------------------------------------------------------------------ errors
    def hook_error(self, where: str, e: BaseException) -> None:
        """A hook failed: counted, logged once per place; the training goes on."""
        self.errors += 1
        if where not in self.warned:
            self.warned.add(where)
            log.warning("trainer_hooks: %s hook failed on rank %s (counted, training goes on): %r",
                        where, self.rank, e)

    # ------------------------------------------------------------------ steps and phases
    def wall(self, perf_ns: int) -> int:
        """Wall-clock ns of a ``perf_counter_ns`` reading in the current step."""
        return self.step_off + perf_ns

    def phase(self, name: str) -> PhaseContext:
        ctx = self._phases.get(name)
        if ctx is None:
            ctx = self._phases[name] = PhaseContext(self, name)
        return ctx

    def begin_step(self, n: int) -> None:
        self.step_n = n
        self.in_step = True
        self.instr_counts[:] = self._counts_zero
        self.step_wall0 = wall0 = self.clock_ns()
        self.step_perf0 = perf0 = perf_counter_ns()
        self.step_off = wall0 - perf0
        clock = self.device_clock
        if clock is None:
            acc = self.acc  # its reset, inline (a call a step saved)
            acc.comm_ns = 0
            acc.sums[:] = _ZEROS
            acc.stack.clear()
            self.step_t0 = perf0
        else:
            self.deferred.append((_STEP_BEGIN, n, None, None))  # reset the accumulator
            self.step_t0 = clock.mark()

    def end_step(self, tokens: int, samples: int, loss: Any, micro_batch: int, micro_batches: int, peak: int) -> None:
        """The step ends, with the loss, batch shape and memory peak in force now."""
        self.in_step = False
        self.current_phase = "idle"
        clock = self.device_clock
        if clock is None:
            acc = self.acc
            s = acc.sums
            self.step_rows.append((self.step_n, self.step_wall0, perf_counter_ns() - self.step_t0, s[0], s[1], s[2],
                                   s[3], acc.comm_ns, tokens, samples, loss, micro_batch, micro_batches, peak,
                                   self.mfu_index))
        else:
            info = (self.step_n, self.step_wall0, tokens, samples, (loss, micro_batch, micro_batches, peak))
            self.deferred.append((_STEP_END, info, self.step_t0, clock.mark()))

    def finish_step(self, n: int, wall0: int, dur: int, tokens: int, samples: int, acc: StepAccumulator,
                    shape: tuple[Any, int, int, int]) -> None:
        """The device clock's STEP row, once its events are done (the CPU path appends it in
        ``end_step``). A row is ``columns.STEP_ROW``: the emitter derives the rest, vectorised."""
        s = acc.sums
        loss, mb, mbs, peak = shape
        if not isinstance(loss, float):  # a device loss: its copy is done (the event is ready)
            loss = resolve_loss(loss)
        self.step_rows.append((n, wall0, dur, s[0], s[1], s[2], s[3], acc.comm_ns, tokens, samples, loss, mb, mbs,
                               peak, self.mfu_index))

    # ------------------------------------------------------------------ pipeline instructions
    def instr_code(self, instr: str) -> int:
        code = self._instr_codes.get(instr)
        if code is None:
            self.instr_names.append(instr)
            code = self._instr_codes[instr] = len(self.instr_names) - 1
            self._counts_zero = (0,) * len(self.instr_names)
            self.instr_counts.append(0)
        return code

    def instr_enter(self, instr: str) -> tuple[Any, int, str]:
        """Device clock: an instruction begins (the CPU path is inlined in integrations.pipeline)."""
        clock = self.device_clock
        assert clock is not None
        counts, code = self.instr_counts, self.instr_code(instr)
        mb = counts[code]
        counts[code] = mb + 1
        prev = self.current_phase
        self.current_phase = _INSTR_PHASE.get(instr, "comm")
        self.deferred.append((_ENTER, None, None, None))
        return clock.mark(), mb, prev

    def instr_exit(self, instr: str, slot: int, token: tuple[Any, int, str], has_mb: bool) -> None:
        clock = self.device_clock
        assert clock is not None
        t0, mb, prev = token
        self.current_phase = prev
        row = (slot, self.step_n, self.wall(perf_counter_ns()), mb if has_mb else -1, instr)
        self.deferred.append((_INSTR, row, t0, clock.mark()))

    # ------------------------------------------------------------------ collectives
    @property
    def pending(self) -> tuple[str, str, int]:
        """(op, role, wall clock ns it entered) of the collective this rank is inside, or ("", "", -1)."""
        sig, t0 = self.pending_sig, self.pending_t0
        if sig < 0:
            return "", "", -1
        op, role = self.signature_table[sig][:2]
        return op, role, self.wall(t0)

    def collective_sig(self, spec: Any, args: tuple, kwargs: dict) -> tuple[int, int]:
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

    def signature(self, spec: Any, group: Any, tensor: Any, is_async: bool, peer: Any) -> int:
        """The signature index of a row the hooks build themselves (a DDP bucket)."""
        key = (spec, group, tensor.dtype if tensor is not None else None, is_async, peer)
        sig = self._sig_cache.get(key)
        if sig is None:
            sig = self._new_sig(spec, group, tensor, is_async, peer, key)
        return sig

    def _new_sig(self, spec: Any, group: Any, tensor: Any, is_async: bool, peer: Any, key: tuple) -> int:
        """First call of its kind: name the group, the peer and the dtype once."""
        role, size = self._group_info(group)
        default_role = getattr(spec, "default_role", "")
        if role in ("world", "group") and default_role:
            role = default_role  # DDP's buckets and broadcasts are data parallel whatever the group
        peer_rank = -1
        if spec.peer_name and peer is not None:
            peer_rank = int(peer)
            role, size = self._peer_role(peer_rank), 2
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else ""
        asynchronous = 1 if (is_async or spec.name in colls.ALWAYS_ASYNC) else 0
        full = (spec.name, role, size, peer_rank, dtype, asynchronous)
        sig = self._sigs.get(full)
        if sig is None:
            sig = self._sigs[full] = len(self.signature_table)
            self.signature_table.append(full)
        self._sig_cache[key] = sig
        return sig

    def collective_enter(self, spec: Any, args: tuple, kwargs: dict) -> tuple:
        """Device clock: name the call and record the start event."""
        clock = self.device_clock
        assert clock is not None
        sig, nbytes = self.collective_sig(spec, args, kwargs)
        self.pending_sig = sig
        t0 = self.pending_t0 = perf_counter_ns()
        return (sig, nbytes, t0, clock.mark())

    def collective_exit(self, token: tuple) -> None:
        """Device clock: record the end event; the emitter does the accounting."""
        clock = self.device_clock
        assert clock is not None
        self.pending_sig = -1
        sig, nbytes, t0, ev0 = token
        self.deferred.append((_COLLECTIVE, (self.step_n, self.wall(t0), nbytes, sig), ev0, clock.mark()))

    # ------------------------------------------------------------------ naming groups
    def set_topology(self, axes: dict[str, list[tuple[int, ...]]], coord_of: Callable[[int], dict[str, int]] | None = None,
                     axis_roles: dict[str, str] | None = None) -> None:
        """Name process groups by their rank sets (see :meth:`trainer_hooks.Tracer.set_topology`)."""
        self.axes = {role: [tuple(sorted(r)) for r in lists] for role, lists in axes.items()}
        self._coord_of = coord_of
        self._axis_roles = dict(axis_roles or {})
        self._forget_names()

    def name_group(self, role: str, ranks: tuple[int, ...]) -> None:
        """Name the group of ``ranks`` (sorted) ``role``, unless the topology already names that set."""
        if any(ranks in lists for lists in self.axes.values()):
            return
        self.axes.setdefault(role, []).append(ranks)
        self._forget_names()

    def _forget_names(self) -> None:
        self._roles.clear()
        self._peer_roles.clear()
        self._sig_cache.clear()
        self.fast_sigs.clear()

    def _group_info(self, group: Any) -> tuple[str, int]:
        info = self._roles.get(group)
        if info is None:
            import torch.distributed.distributed_c10d as c10d

            try:
                pg = group if group is not None else c10d._get_default_group()
                ranks = tuple(c10d.get_process_group_ranks(pg))
            except Exception:
                ranks = tuple(range(self.world_size))
            info = (colls.classify_ranks(ranks, self.axes, self.world_size), len(ranks))
            self._roles[group] = info
        return info

    def _peer_role(self, peer: int) -> str:
        role = self._peer_roles.get(peer)
        if role is None:
            role = self._peer_roles[peer] = colls.peer_role(self._coord_of, self.rank, peer, self._axis_roles)
        return role
