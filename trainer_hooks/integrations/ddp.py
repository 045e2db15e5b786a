"""DDP and FSDP: found at their first forward, DDP's gradient buckets timed through its
communication-hook API, their process groups named ``dp``.

Why this module exists: DDP's C++ reducer all-reduces the gradient buckets by calling the process
group directly, so the ``torch.distributed`` wrapper (:mod:`trainer_hooks.integrations.collectives`) never
sees them; without this a rank that waits 80 ms for a straggler in backward reads as 80 ms of its
own compute. (FSDP2's ``all_gather_single`` / ``reduce_scatter_single`` and FSDP1's ``all_gather``
/ ``reduce_scatter_single`` are plain ``torch.distributed`` calls: the wrapper times them; this
module only names their groups ``dp``.) Measurements behind each choice:
``shared/notes/ddp-fsdp-instrumentation.md``.

Finding the modules, without a change to the user's loop: a global forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``, public) looks at every module
called until the second step in which modules run has begun (or 250,000 module calls, for a loop
without ``tracer.step``), then removes itself (while it is there every module call costs ~1 us
more: a global hook takes torch off its hook-free fast path).
It finds ``DistributedDataParallel``, FSDP2 (``FSDPModule``) and FSDP1
(``FullyShardedDataParallel``) modules, wherever and whenever they were built. A DDP module used
for the first time later than that is not found: pass it to :func:`watch`.

Timing a DDP bucket (``_timed``): the registered hook wraps DDP's default
(``default_hooks.allreduce_hook``, the documented equivalent of the built-in path) or the user's
own hook, and times each bucket from the hook call (its gradients are ready) to its future's
completion, in a ``then`` callback on the process group's thread (gloo). No device sync, no lock,
no per-event protobuf: one tuple appended per bucket, as the wrapper does.

Exposed communication: the time backward waits after its last bucket is handed over, i.e.
``max(done) - ready(last bucket)`` over one backward pass, is added to the step's communication
time (the training thread is blocked in DDP's finalize while it is added), so it leaves the
``backward`` phase's self time, as the wrapper's blocking collectives do.

DDP allows one comm hook, ever, per module. A hook the user registers after the Tracer exists is
wrapped (``DDP.register_comm_hook`` is re-pointed while a Tracer is installed; if ours is already
in, the user's goes inside it, so the user's call still works). A hook registered *before* the
Tracer existed, or a built-in C++ hook, cannot be wrapped: that module's buckets are not timed and
a warning says how to fix it.

On GPU (the Tracer's device clock, CUDA events): a bucket's future completes on the host long
before its all-reduce does (NCCL marks it complete at enqueue; its ``then`` callbacks run at once
on a stream made to wait for the all-reduce), so host clocks time nothing there. Instead two
events per bucket: one recorded on the current stream in the hook (done on the device when the
bucket's gradients are), one recorded in the completion callback, on the stream the future's
callbacks run on (done when the all-reduce is). The pass's last completion hands the pass to the
emitter (one deque append, as every GPU phase and collective does); the emitter, once every
event of it is done (``query()``), writes each bucket's row (``elapsed_time`` of its pair) and adds
the exposed wait, ``max(done) - ready(last bucket)`` in device time, to the step's communication,
at its place in recording order (inside the ``backward`` phase: DDP's finalize makes the training
stream wait for the buckets, so backward's device time holds that wait). The training thread
never asks the device anything: no ``synchronize``, no ``query``, no ``elapsed_time``.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
import weakref
from typing import TYPE_CHECKING, Any

from tracetop import env as tenv
from trainer_hooks.device_clock import DeferredOp
from trainer_hooks.integrations import collectives as colls

if TYPE_CHECKING:
    from trainer_hooks.recorder import Recorder
    from trainer_hooks.tracer import Tracer

log = logging.getLogger("trainer_hooks")
perf_counter_ns = time.perf_counter_ns

#: module calls after which the global forward pre-hook goes even if no second step began
MAX_WATCHED_CALLS = 250_000

#: the op name of a DDP bucket row ("all_reduce" prefix: busbw takes the all-reduce factor)
DDP_OP = "all_reduce_ddp"


class _RowSpec:
    """What the Recorder's signature table needs to name a DDP bucket row (like collectives._Spec)."""

    __slots__ = ("name", "peer_name", "default_role")

    def __init__(self, name: str) -> None:
        self.name = name
        self.peer_name = ""
        self.default_role = "dp"


_BUCKET = _RowSpec(DDP_OP)


class _Pass:
    """One backward pass of one DDP module: written by the training thread at each hook call,
    read by the completion callbacks (the n-th completion, by ticket, closes the pass)."""

    __slots__ = ("n", "ready_last_ns", "dones", "tickets", "buckets", "ev_last")

    def __init__(self) -> None:
        self.n = -1  # buckets in this pass: known once the last one (is_last()) was handed over
        self.ready_last_ns = 0
        self.dones: list[int] = []
        self.tickets = itertools.count()  # next() is one C call: atomic under the GIL
        # device clock: (step, wall0, bytes, sig, ready event, done event) per bucket, and the
        # ready event of the last bucket
        self.buckets: list[tuple] = []
        self.ev_last: Any = None


class _Cell:
    """The hook one DDP module calls: the inner hook and its state can be swapped when the user
    registers a hook after ours was put in (DDP refuses a second registration)."""

    __slots__ = ("inner", "state", "user", "group", "current", "__weakref__")

    def __init__(self, inner: Any, state: Any, group: Any, user: bool) -> None:
        self.inner = inner
        self.state = state
        self.group = group
        self.user = user  # True: the inner hook is the user's
        self.current = _Pass()


class _State:
    def __init__(self) -> None:
        self.sink: Recorder | None = None  # the Tracer's recorder; None = every timed hook passes straight through
        self.handle: Any = None  # the global forward pre-hook, while watching
        self.first_step: int | None = None
        self.calls = 0  # module calls seen while watching
        self.kinds: tuple[type, ...] | None = None
        self.seen: weakref.WeakSet = weakref.WeakSet()
        self.originals: dict[str, Any] = {}
        self.warned: set[str] = set()
        self.time_buckets = True  # TRACETOP_DDP_BUCKETS=0: leave DDP's built-in all-reduce alone


_state = _State()


# ----------------------------------------------------------------------------- install


def install(rec: Recorder) -> bool:
    """Watch for DDP/FSDP modules on behalf of a Tracer's recorder (one at a time, as the wrapper).
    Returns False where torch.distributed is not there."""
    try:
        import torch.distributed as dist
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:
        return False
    if not dist.is_available():
        return False
    try:
        if not _state.originals:
            _state.originals = {"register_comm_hook": DDP.register_comm_hook,
                                "_register_builtin_comm_hook": DDP._register_builtin_comm_hook}
            DDP.register_comm_hook = _register_comm_hook
            DDP._register_builtin_comm_hook = _register_builtin_comm_hook
        _state.sink = rec
        _state.time_buckets = tenv.get(tenv.TRACETOP_DDP_BUCKETS, "1") != "0"
        _state.first_step = None
        _state.calls = 0
        _state.kinds = None
        if _state.handle is None:
            _state.handle = register_module_forward_pre_hook(_on_forward)
    except Exception as e:  # a torch without these seams: DDP stays unseen, the rest of the Tracer works
        rec.hook_error("ddp", e)
        uninstall(rec)
        return False
    return True


def uninstall(rec: Recorder | None = None) -> None:
    """Stop watching and put DDP's methods back. Hooks already registered stay (DDP has no way to
    remove one) and pass every bucket straight to the inner hook from now on."""
    if rec is not None and _state.sink is not rec:
        return
    _state.sink = None
    _stop_watching()
    if _state.originals:
        from torch.nn.parallel import DistributedDataParallel as DDP

        for name, fn in _state.originals.items():
            setattr(DDP, name, fn)
        _state.originals = {}


def watch(module: Any, tracer: Tracer | None = None) -> None:
    """Time / name one module now (for a DDP or FSDP module first used after the Tracer stopped
    watching, see the module docstring); ``tracer``: the installed Tracer's by default."""
    if tracer is not None and not tracer.enabled:
        return
    t = tracer.recorder if tracer is not None else _state.sink
    if t is None:
        return
    try:
        _found(t, module, _kinds())
    except Exception as e:
        t.hook_error("ddp", e)


def watching() -> bool:
    """The global forward pre-hook is in (modules are still being looked at)."""
    return _state.handle is not None


def watched_calls() -> int:
    """Module calls seen while watching."""
    return _state.calls


def leave_untimed(module: Any) -> None:
    """Never time or name ``module`` (a benchmark's plain arm)."""
    _state.seen.add(module)


def register_untimed_hook(module: Any, state: object, hook: Any) -> None:
    """DDP's own ``register_comm_hook`` on ``module`` while a Tracer is installed: ``hook`` runs
    untimed (a benchmark's arm on DDP's Python hook path)."""
    _state.originals["register_comm_hook"](module, state, hook)


def _stop_watching() -> None:
    handle, _state.handle = _state.handle, None
    if handle is not None:
        handle.remove()


def _kinds() -> tuple[type, ...]:
    """(DDP, FSDP2's FSDPModule, FSDP1's FullyShardedDataParallel) as far as they are imported."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    kinds: list[type] = [DDP]
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for name in ("FSDPModule", "FullyShardedDataParallel"):
        cls = getattr(fsdp, name, None) if fsdp is not None else None
        if isinstance(cls, type):
            kinds.append(cls)
    return tuple(kinds)


def _on_forward(module: Any, args: Any) -> None:
    """The global forward pre-hook: returns None (never changes the input)."""
    t = _state.sink
    if t is None:
        return None
    try:
        kinds = _state.kinds
        if kinds is None:  # first call: the model exists by now, so FSDP is imported if used
            kinds = _state.kinds = _kinds()
        if isinstance(module, kinds) and module not in _state.seen:
            _found(t, module, kinds)
        if t.in_step:
            if _state.first_step is None:
                _state.first_step = t.step_n
            elif t.step_n != _state.first_step:
                _stop_watching()  # every module the loop uses ran in the first step
        _state.calls += 1
        if _state.calls > MAX_WATCHED_CALLS:  # a loop without tracer.step: stop paying ~1 us a call
            _stop_watching()
    except Exception as e:
        t.hook_error("ddp", e)
    return None


def _found(t: Recorder, module: Any, kinds: tuple[type, ...]) -> None:
    _state.seen.add(module)
    if isinstance(module, kinds[0]):  # DDP
        _name_dp(t, getattr(module, "process_group"))  # noqa: B009  (kinds[0] is typed as a bare type)
        _attach(t, module)
        return
    mesh = None
    for p in module.parameters():  # FSDP2: DTensor parameters on the data-parallel mesh
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            break
    if mesh is not None:
        for dim in range(mesh.ndim):  # HSDP: (replicate, shard); both are data parallel
            _name_dp(t, mesh.get_group(dim))
    for attr in ("process_group", "_inter_node_pg"):  # FSDP1 (hybrid sharding has both)
        pg = getattr(module, attr, None)
        if pg is not None and mesh is None:
            _name_dp(t, pg)


def _name_dp(t: Recorder, group: Any) -> None:
    """Name ``group`` ``dp`` unless the user's topology already names its rank set."""
    import torch.distributed as dist

    t.name_group("dp", tuple(sorted(dist.get_process_group_ranks(group))))


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _state.warned:
        _state.warned.add(key)
        log.warning(msg, *args)


# ----------------------------------------------------------------------------- DDP comm hooks


def _attach(t: Recorder, ddp: Any) -> None:
    """Put the timed default hook on a DDP module that has none."""
    if getattr(ddp, "_tracetop_cell", None) is not None or not _state.time_buckets:
        return  # timed already (a hook the user registered while we were installed, or an earlier Tracer)
    if ddp._comm_hooks or _builtin_hook(ddp):
        name = ddp._comm_hooks[0][0] if ddp._comm_hooks else _builtin_hook(ddp)
        _warn_once("ddp-hook", "trainer_hooks: a DDP module already has the comm hook %r, registered before the "
                   "Tracer existed; DDP takes one hook, once, so its gradient buckets are not timed. Create the "
                   "Tracer before registering the hook (hooks registered later are timed)",
                   getattr(name, "__qualname__", name))
        return
    cell = _Cell(_allreduce_mean, ddp.process_group, ddp.process_group, user=False)
    _state.originals["register_comm_hook"](ddp, ddp.process_group, _timed(cell))
    ddp._tracetop_cell = cell


def _allreduce_mean(group: Any, bucket: Any) -> Any:
    """DDP's default, as ``default_hooks.allreduce_hook`` does it (divide by the group's size, then
    sum), straight on the process group: the same result without the Python layers of
    ``dist.all_reduce`` and its extra ``then`` callback (``tracetop bench hooks --ddp`` measures both)."""
    return _allreduce_mean_raw(group, bucket).then(_first)


def _allreduce_mean_raw(group: Any, bucket: Any) -> Any:
    """The same, its future's value a one-tensor list (``_timed`` takes the tensor out in its own
    callback: one Python callback per bucket instead of two)."""
    buf = bucket.buffer()
    buf.div_(group.size())
    return group.allreduce([buf]).get_future()


def _first(fut: Any) -> Any:
    return fut.value()[0]


def _builtin_hook(ddp: Any) -> str:
    try:
        name = ddp._get_ddp_logging_data().get("comm_hook") or ""
    except Exception:
        return ""
    return name if "BuiltinCommHookType" in str(name) else ""


def _register_comm_hook(self: Any, state: object, hook: Any) -> None:
    """``DDP.register_comm_hook`` while a Tracer is installed: the user's hook, timed."""
    original = _state.originals["register_comm_hook"]
    if not _state.time_buckets:
        return original(self, state, hook)
    cell = getattr(self, "_tracetop_cell", None)
    if cell is not None and not cell.user:
        # ours (the timed default) is in and DDP takes one hook: the user's goes inside it
        self._check_comm_hook(hook)
        cell.inner, cell.state, cell.user = hook, state, True
        self.logger._set_comm_hook_name(getattr(hook, "__qualname__", str(hook)))
        return None
    if cell is not None:  # a second registration: DDP's own error
        return original(self, state, hook)
    cell = _Cell(hook, state, self.process_group, user=True)
    original(self, state, _timed(cell))
    self._tracetop_cell = cell
    return None


def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
    """``DDP._register_builtin_comm_hook`` while a Tracer is installed: untimed as before, unless our
    timed default is in already (then the Python equivalent goes inside it)."""
    cell = getattr(self, "_tracetop_cell", None)
    if cell is not None and not cell.user:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        same = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}.get(comm_hook_type)
        if same is not None:
            cell.inner, cell.state, cell.user = same, self.process_group, True
            self.logger._set_comm_hook_name(str(comm_hook_type))
            return None
    return _state.originals["_register_builtin_comm_hook"](self, comm_hook_type)


def _timed(cell: _Cell) -> Any:
    """The function DDP calls for each bucket (its parameter must be named ``bucket``)."""
    local = colls.call_flag

    def timed_hook(state, bucket):  # DDP refuses annotations other than its own
        t = _state.sink
        inner, inner_state = cell.inner, cell.state
        if t is None or not hasattr(bucket, "buffer"):
            return inner(inner_state, bucket)  # no Tracer, or the Python reducer's (grad, param)
        if t.device_clock is not None:
            return _timed_on_device(t, cell, inner, inner_state, bucket, local)
        try:
            i, p, nbytes, sig = _bucket_of(t, cell, bucket)
            step = t.step_n
            t0 = perf_counter_ns()
            wall0 = t.step_wall0 + (t0 - t.step_perf0)
            if bucket.is_last():  # DDP hands buckets over in index order: compute is done now
                p.ready_last_ns = t0
                p.n = i + 1
                t.pending_sig, t.pending_t0 = sig, t0  # the heartbeat shows the wait
        except Exception as e:
            t.hook_error("ddp", e)
            return inner(inner_state, bucket)
        unwrap, fut = _run_inner(inner, inner_state, bucket, local)
        rows, dones, tickets = t.collective_rows, p.dones, p.tickets

        def done(f: Any) -> Any:  # the process group's thread (or inline, if already complete)
            try:
                d = perf_counter_ns()
                rows.extend((step, wall0, d - t0, nbytes, sig))
                dones.append(d)
                if next(tickets) == p.n - 1:  # the pass's last completion: close it
                    exposed = max(dones) - p.ready_last_ns
                    if exposed > 0:
                        # the training thread is blocked in DDP's finalize_backward until we return
                        t.acc.comm_ns += exposed
                    if t.pending_sig == sig:
                        t.pending_sig = -1
            except Exception as e:  # a raise here would fail backward()
                t.hook_error("ddp", e)
            return f.value()[0] if unwrap else f.value()

        return fut.then(done)

    # DDP reads __name__ (bf16 hooks are checked by name) and logs __qualname__: keep the inner's
    timed_hook.__name__ = getattr(cell.inner, "__name__", "timed_hook")
    timed_hook.__qualname__ = getattr(cell.inner, "__qualname__", timed_hook.__name__)
    timed_hook._tracetop_timed = True  # type: ignore[attr-defined]
    return timed_hook


# ----------------------------------------------------------------------------- the device clock (GPU)


def _bucket_of(t: Recorder, cell: _Cell, bucket: Any) -> tuple[int, Any, int, int]:
    """A bucket's index, its backward pass (a new one at bucket 0), its bytes and its signature."""
    i = bucket.index()
    if i == 0:
        cell.current = _Pass()
    buf = bucket.buffer()
    sig = t.signature(_BUCKET, cell.group, buf, True, None)
    return i, cell.current, buf.numel() * buf.element_size(), sig


def _run_inner(inner: Any, inner_state: Any, bucket: Any, local: Any) -> tuple[bool, Any]:
    """The wrapped hook's future, and whether it is ours (whose future holds a one-element list)."""
    if inner is _allreduce_mean:  # ours: no torch.distributed call inside
        return True, _allreduce_mean_raw(inner_state, bucket)
    inside = local.inside
    local.inside = True  # the inner hook's dist.all_reduce is this row, not a row of its own
    try:
        return False, inner(inner_state, bucket)
    finally:
        local.inside = inside


def _timed_on_device(t: Recorder, cell: _Cell, inner: Any, inner_state: Any, bucket: Any, local: Any) -> Any:
    """One bucket on the device clock (the module docstring says why events, and which)."""
    cuda = t.device_clock
    assert cuda is not None
    try:
        i, p, nbytes, sig = _bucket_of(t, cell, bucket)
        step = t.step_n
        wall0 = t.step_wall0 + (perf_counter_ns() - t.step_perf0)
        ev0 = cuda.mark()  # the current stream: done on the device once this bucket's gradients are
        if bucket.is_last():
            p.ev_last = ev0
            p.n = i + 1
    except Exception as e:
        t.hook_error("ddp", e)
        return inner(inner_state, bucket)
    unwrap, fut = _run_inner(inner, inner_state, bucket, local)
    buckets, tickets, deferred = p.buckets, p.tickets, t.deferred

    def done(f: Any) -> Any:
        # a CUDA future runs its callbacks on a stream made to wait for the all-reduce (NCCL: at
        # once, on the thread that issued it; gloo: on its thread): an event recorded here is done
        # on the device when the bucket is
        try:
            buckets.append((step, wall0, nbytes, sig, ev0, cuda.mark()))
            if next(tickets) == p.n - 1:  # the pass's last completion: hand it to the emitter
                deferred.append((DeferredOp.PASS, buckets, p.ev_last, None))
        except Exception as e:  # a raise here would fail backward()
            t.hook_error("ddp", e)
        return f.value()[0] if unwrap else f.value()

    return fut.then(done)
