"""Automatic collective timing: every torch.distributed collective, wrapped in place and restored.

Each function is replaced in BOTH ``torch.distributed`` and ``torch.distributed.distributed_c10d``
with the same wrapper object (c10d compares ``isend``/``irecv`` by identity, and calls its own
module globals: ``send`` -> ``isend``, ``all_gather_into_tensor`` -> ``all_gather_single``). A
thread-local flag makes nested calls count once, under the outermost name. DeepSpeed's comm
backend keeps references to ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` taken at
``init_distributed``; :func:`install` re-points them (``deepspeed.comm.comm.cdb``) when DeepSpeed
is loaded, and :func:`uninstall` puts everything back. An op whose parameters are all plain and
whose one tensor comes first (``all_reduce``, ``broadcast``, ``reduce``, ...) gets a wrapper with its
own parameters (:mod:`trainer_hooks.integrations.bound_call`: no keyword dict a call); the others
the general ``(*args, **kwargs)`` one.

Bytes follow the NCCL-tests "size" convention: the tensor for all_reduce / broadcast / reduce /
send / recv; the whole output for the all-gathers; the whole input for reduce-scatter and
all-to-all. ``busbw_factor`` gives busbw = algbw x factor for each op.

Async calls (``async_op=True``, ``isend``/``irecv``, ``batch_isend_irecv``) are marked
``is_async=1``. Their step's exposed communication is the time a training thread spends issuing
them; their row's duration is issue to completion, read in the returned Work's future callback
(:mod:`trainer_hooks.integrations.async_done`; never a wait), or until they return where the Work has no
future (``batch_isend_irecv``'s list, a backend's p2p work without one).
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable, Iterable
from threading import get_ident
from typing import TYPE_CHECKING, Any

from trainer_hooks.integrations import async_done, bound_call

if TYPE_CHECKING:
    from trainer_hooks.recorder import Recorder

#: op -> how to find the payload: ("arg", index) one tensor, ("list", index) a list of tensors,
#: ("lists", index) a list of lists, ("p2p", 0) a list of P2POp, None no payload.
PAYLOAD: dict[str, tuple[str, int] | None] = {
    "all_reduce": ("arg", 0),
    "all_reduce_coalesced": ("list", 0),
    "reduce": ("arg", 0),
    "broadcast": ("arg", 0),
    "all_gather": ("list", 0),
    "all_gather_single": ("arg", 0),
    "all_gather_into_tensor": ("arg", 0),
    "_all_gather_base": ("arg", 0),
    "all_gather_coalesced": ("lists", 0),
    "reduce_scatter": ("list", 1),
    "reduce_scatter_single": ("arg", 1),
    "reduce_scatter_tensor": ("arg", 1),
    "_reduce_scatter_base": ("arg", 1),
    "all_to_all": ("list", 1),
    "all_to_all_single": ("arg", 1),
    "send": ("arg", 0),
    "recv": ("arg", 0),
    "isend": ("arg", 0),
    "irecv": ("arg", 0),
    "batch_isend_irecv": ("p2p", 0),
    "gather": ("arg", 0),
    "scatter": ("arg", 0),
    "barrier": None,
    "monitored_barrier": None,
    # DDP's own (C++ builtins on torch.distributed, no signature): the parameter and buffer broadcast
    # at construction (and of the buffers before each forward), and the parameter-shape check
    # (an all-gather of shapes: no payload of note)
    "_broadcast_coalesced": ("list", 1),
    "_verify_params_across_processes": None,
}

#: ops whose process group is their first positional argument (builtins: no signature to read)
GROUP_ARG = {"_broadcast_coalesced": 0, "_verify_params_across_processes": 0}
#: the role of ops that only data parallelism issues, where the group has no other name
DEFAULT_ROLE = {"_broadcast_coalesced": "dp", "_verify_params_across_processes": "dp"}

#: ops that are point-to-point (peer from the dst/src argument, role from the peer's coordinates)
P2P_PEER_ARG = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src"}
ALWAYS_ASYNC = {"isend", "irecv", "batch_isend_irecv"}


def busbw_factor(op: str, group_size: int) -> float:
    """NCCL-tests: busbw = algbw x factor (all_reduce 2(n-1)/n; gathers, scatters, all-to-all (n-1)/n;
    broadcast, reduce and point-to-point 1)."""
    n = max(1, group_size)
    if op.startswith("all_reduce"):
        return 2.0 * (n - 1) / n
    if op.startswith(("all_gather", "_all_gather", "reduce_scatter", "_reduce_scatter", "all_to_all")):
        return (n - 1) / n
    return 1.0


class _Spec:
    """Where one op's arguments sit, found once from its signature."""

    __slots__ = ("name", "kind", "index", "arg_name", "group_i", "async_i", "peer_name", "peer_i", "group_peer_name",
                 "group_peer_i", "default_role")

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        payload = PAYLOAD[name]
        self.kind, self.index = payload if payload else ("none", 0)
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        self.arg_name = params[self.index] if self.index < len(params) else ""
        self.group_i = params.index("group") if "group" in params else GROUP_ARG.get(name, -1)
        self.default_role = DEFAULT_ROLE.get(name, "")
        self.async_i = params.index("async_op") if "async_op" in params else -1
        self.peer_name = P2P_PEER_ARG.get(name, "")
        self.peer_i = params.index(self.peer_name) if self.peer_name in params else -1
        self.group_peer_name = "group_" + self.peer_name if self.peer_name else ""
        self.group_peer_i = params.index(self.group_peer_name) if self.group_peer_name in params else -1


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if 0 <= i < len(args) else None


def _nbytes(t: Any) -> int:
    return t.nbytes


def payload(spec: _Spec, args: tuple, kwargs: dict) -> tuple[int, Any]:
    """(bytes, first tensor) of a call."""
    kind = spec.kind
    if kind == "none":
        return 0, None
    x = args[spec.index] if spec.index < len(args) else kwargs.get(spec.arg_name)
    if x is None:
        return 0, None
    if kind == "arg":
        return _nbytes(x), x
    if kind == "list":
        return sum(_nbytes(t) for t in x), (x[0] if len(x) else None)
    if kind == "lists":
        return sum(_nbytes(t) for lst in x for t in lst), (x[0][0] if len(x) and len(x[0]) else None)
    # p2p op list
    return sum(_nbytes(p.tensor) for p in x), (x[0].tensor if len(x) else None)


class _Inside:
    """Which threads are inside a timed call. One thread, the ``owner`` (the first to point the
    wrappers at a sink: the training thread), has a flag of its own (``owner_in``, an attribute
    write each way); every other thread's id is kept in the set ``tids`` (a test, an add and a
    discard: ~130 ns a call in a tight loop, against ~25 ns for the flag). ``.inside`` reads and sets
    it for the calling thread (the DDP hook); the wrappers test and edit it themselves."""

    __slots__ = ("tids", "owner", "owner_in")

    def __init__(self) -> None:
        self.tids: set[int] = set()
        self.owner = -1  # set once (claim): a thread id, never -1
        self.owner_in = False

    def claim(self) -> None:
        """The calling thread owns the flag, unless a thread already does (an owner never changes:
        its flag may be set by a call in progress)."""
        if self.owner == -1:
            self.owner = get_ident()

    @property
    def inside(self) -> bool:
        tid = get_ident()
        return self.owner_in if tid == self.owner else tid in self.tids

    @inside.setter
    def inside(self, value: bool) -> None:
        tid = get_ident()
        if tid == self.owner:
            self.owner_in = bool(value)
        elif value:
            self.tids.add(tid)
        else:
            self.tids.discard(tid)


class _KwKey:
    """The key of one wrapper's keyword-call cache in ``Recorder.fast_sigs`` (hashed by identity:
    a tuple key would be hashed anew at every call)."""

    __slots__ = ()


class _Installed:
    def __init__(self) -> None:
        self.sink: Recorder | None = None  # the Tracer's recorder receiving calls; None = pass through
        self.originals: dict[tuple[Any, str], Any] = {}
        self.local = _Inside()
        self.cdb_originals: dict[str, Any] = {}


_installed = _Installed()
#: the thread-local "inside a timed call" flag (``.inside``): nested calls, and a DDP hook's inner
#: ``dist.all_reduce`` (:mod:`trainer_hooks.integrations.ddp`), count once
call_flag = _installed.local


def _make_wrapper(spec: _Spec, fn: Callable[..., Any], bound: bool = True) -> Callable[..., Any]:
    state = _installed
    local = state.local
    clock = time.perf_counter_ns
    # one tensor as the only argument (``all_reduce(t)``): no group, not async, no peer, so the
    # signature depends on the dtype alone: looked up by (spec, dtype) without naming the call
    one_tensor = spec.kind == "arg" and spec.index == 0 and 0 not in (spec.group_i, spec.async_i, spec.peer_i)
    # the tensor first or named, the rest named (DeepSpeed's comm backend: ``all_reduce(tensor=t,
    # op=op, group=g, async_op=a)``): the signature depends on (dtype, group, async) alone, looked
    # up in ``fast_sigs[kw_key]`` (cleared with the rest when groups are renamed). Both caches are
    # read by subscript (a miss raises KeyError, once per key): cheaper than two ``dict.get`` calls
    by_name = one_tensor and not spec.peer_name
    kw_key, tensor_name = _KwKey(), spec.arg_name

    inside = local.tids
    fast = bound_call.make(spec, fn, state, _device_timed, kw_key) if bound else None  # fn's own parameters
    if fast is not None:
        return _named(fast, spec, fn)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sink = state.sink
        tid = get_ident()
        mine = tid == local.owner
        if sink is None or (local.owner_in if mine else tid in inside):
            return fn(*args, **kwargs)
        if sink.device_clock is not None:
            return _device_timed(sink, spec, fn, args, kwargs)
        # CPU: the hot path, inlined (a dict lookup to name the call, two clock reads, one append)
        try:
            if one_tensor and not kwargs and len(args) == 1 and (tensor := args[0]) is not None:
                nbytes = tensor.nbytes
                try:
                    sig = sink.fast_sigs[spec][tensor.dtype]
                except KeyError:  # the first call of its dtype (since groups were last named)
                    sig, nbytes = sink.collective_sig(spec, args, kwargs)
                    sink.fast_sigs.setdefault(spec, {})[tensor.dtype] = sig
            elif by_name and kwargs and len(args) <= 1 and (tensor := args[0] if args else kwargs.get(tensor_name)) is not None:
                nbytes = tensor.nbytes
                key = (tensor.dtype, kwargs.get("group"), kwargs.get("async_op", False))
                try:
                    sig = sink.fast_sigs[kw_key][key]
                except KeyError:
                    sig, nbytes = sink.collective_sig(spec, args, kwargs)
                    sink.fast_sigs.setdefault(kw_key, {})[key] = sig
            else:
                sig, nbytes = sink.collective_sig(spec, args, kwargs)
        except Exception as e:  # a hook never breaks the call it observes
            sink.hook_error("collective", e)
            return fn(*args, **kwargs)
        if mine:
            local.owner_in = True
        else:
            inside.add(tid)
        sink.pending_sig = sig
        ret = None
        t0 = sink.pending_t0 = clock()
        try:
            ret = fn(*args, **kwargs) if kwargs else fn(*args)
            return ret
        finally:
            dur = clock() - t0
            if mine:
                local.owner_in = False
            else:
                inside.discard(tid)
            sink.pending_sig = -1
            try:
                sink.acc.comm_ns += dur
                # an async call's Work: its row is written at completion (trainer_hooks.integrations.async_done)
                if ret is None or not async_done.track(sink, ret, sink.step_n, sink.step_off + t0, t0, nbytes, sig):
                    sink.collective_rows.extend((sink.step_n, sink.step_off + t0, dur, nbytes, sig))
            except Exception as e:
                sink.hook_error("collective", e)

    return _named(wrapper, spec, fn)


def _named(wrapper: Callable[..., Any], spec: _Spec, fn: Callable[..., Any]) -> Callable[..., Any]:
    wrapper.__name__ = getattr(fn, "__name__", spec.name)
    wrapper.__qualname__ = getattr(fn, "__qualname__", spec.name)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper._tracetop_wrapper = True  # type: ignore[attr-defined]
    return wrapper


def _device_timed(sink: Recorder, spec: _Spec, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """GPU: CUDA events around the call, resolved later by the emitter."""
    local = _installed.local
    try:
        token = sink.collective_enter(spec, args, kwargs)
    except Exception as e:
        sink.hook_error("collective", e)
        return fn(*args, **kwargs)
    local.inside = True
    ret = None
    try:
        ret = fn(*args, **kwargs)
        return ret
    finally:
        local.inside = False
        try:
            if ret is not None and async_done.track_device(sink, ret, token):  # timed to completion
                sink.pending_sig = -1
            else:
                sink.collective_exit(token)
        except Exception as e:
            sink.hook_error("collective", e)


def install(sink: Recorder, ops: Iterable[str] = tuple(PAYLOAD)) -> list[str]:
    """Route every listed collective through ``sink`` (a Tracer's recorder). One sink at a time: installing
    again re-targets the existing wrappers. Returns the op names wrapped."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if _installed.originals:
        _installed.sink = sink
        _installed.local.claim()
        return sorted({name for _, name in _installed.originals})
    wrapped = []
    for name in ops:
        fn = getattr(c10d, name, None) or getattr(dist, name, None)
        if fn is None or getattr(fn, "_tracetop_wrapper", False):
            continue
        w = _make_wrapper(_Spec(name, fn), fn)
        for mod in (dist, c10d):
            if getattr(mod, name, None) is fn:
                _installed.originals[(mod, name)] = fn
                setattr(mod, name, w)
        wrapped.append(name)
    _repoint_deepspeed(dist)
    _installed.sink = sink
    _installed.local.claim()
    return wrapped


def _repoint_deepspeed(dist: Any) -> None:
    """DeepSpeed's TorchBackend caches two functions at init_distributed(); point them at ours."""
    comm = sys.modules.get("deepspeed.comm.comm")
    cdb = getattr(comm, "cdb", None) if comm is not None else None
    if cdb is None:
        return
    for attr, name in (("all_gather_function", "all_gather_into_tensor"), ("reduce_scatter_function", "reduce_scatter_tensor")):
        current = getattr(cdb, attr, None)
        original = _installed.originals.get((dist, name))
        if current is not None and current is original:
            _installed.cdb_originals[attr] = current
            setattr(cdb, attr, getattr(dist, name))


def uninstall(sink: Recorder | None = None) -> None:
    """Put every original function back (only if ``sink`` is the installed one, when given)."""
    if sink is not None and _installed.sink is not sink:
        return
    _installed.sink = None
    for (mod, name), fn in _installed.originals.items():
        setattr(mod, name, fn)
    _installed.originals.clear()
    comm = sys.modules.get("deepspeed.comm.comm")
    cdb = getattr(comm, "cdb", None) if comm is not None else None
    for attr, fn in _installed.cdb_originals.items():
        if cdb is not None:
            setattr(cdb, attr, fn)
    _installed.cdb_originals.clear()


def installed_sink() -> Recorder | None:
    return _installed.sink


def route_to(sink: Recorder | None) -> None:
    """Point the installed wrappers at ``sink`` (None: every call passes straight through), leaving
    them in place (the overhead benchmark switches the hooks on and off this way)."""
    _installed.sink = sink
    if sink is not None:
        _installed.local.claim()


def originals() -> dict[tuple[Any, str], Any]:
    """(module, name) -> the original function, for every function wrapped now."""
    return dict(_installed.originals)


def deepspeed_originals() -> dict[str, Any]:
    """DeepSpeed comm backend attribute -> the original it held before :func:`install` re-pointed it."""
    return dict(_installed.cdb_originals)


def wrap_function(name: str, fn: Callable[..., Any], *, bound: bool = True) -> Callable[..., Any]:
    """A timed wrapper of ``fn`` as the collective ``name`` (a key of :data:`PAYLOAD`), without
    installing it: benchmarks and tests time a stand-in this way. ``bound=False``: the general
    ``(*args, **kwargs)`` form even where the fast one (:mod:`.bound_call`) applies."""
    return _make_wrapper(_Spec(name, fn), fn, bound)


# ----------------------------------------------------------------------------- roles


def classify_ranks(ranks: tuple[int, ...], axes: dict[str, list[tuple[int, ...]]], world_size: int) -> str:
    """The role of a group from its rank set: every axis whose groups include this exact set,
    joined with '|' in the order given; ``world`` when it is every rank and no axis matched;
    ``group`` when nothing matched (a user's own group)."""
    key = tuple(sorted(ranks))
    names = [role for role, lists in axes.items() if key in lists]
    if names:
        return "|".join(names)
    if len(key) == world_size:
        return "world"
    return "group"


def peer_role(coord_of: Callable[[int], dict[str, int]] | None, rank: int, peer: int, axis_roles: dict[str, str]) -> str:
    """Point-to-point role: ``p2p:<role>`` of the one axis on which the two ranks differ."""
    if coord_of is None or peer < 0:
        return "p2p"
    try:
        a, b = coord_of(rank), coord_of(peer)
    except Exception:
        return "p2p"
    differ = [axis for axis in a if a[axis] != b.get(axis)]
    if len(differ) == 1 and differ[0] in axis_roles:
        return "p2p:" + axis_roles[differ[0]]
    return "p2p"
