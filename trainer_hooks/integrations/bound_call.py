"""The collective wrapper with the wrapped function's own parameters (the hot path's fast form).

A ``wrapper(*args, **kwargs)`` makes a dict at every call and walks ``args``/``kwargs`` to find the
tensor, the group and ``async_op``. For an op whose parameters are all plain (positional or
keyword, no ``*``/``**``, no positional-only or keyword-only) and whose one tensor comes first
(``all_reduce(tensor, op, group, async_op)``, ``broadcast``, ``reduce``, ...), the wrapper is
generated with the same parameters and defaults: the interpreter binds the call, the wrapper reads
its tensor, group and ``async_op`` by name, and calls the function with every parameter
positional (the same values it would have bound itself). In a tight loop: ~600 against ~720 ns a
call on the shared CPU machine. Rows are the general wrapper's (tests/trainer_hooks/test_hot_path_forms.py).

A call the function would refuse (a wrong keyword) is refused here by the same ``TypeError``,
before anything is recorded.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from threading import get_ident
from typing import Any

from trainer_hooks.integrations import async_done

_TEMPLATE = '''
def wrapper({params}):
    sink = state.sink
    tid = get_ident()
    mine = tid == flag.owner
    if sink is None or (flag.owner_in if mine else tid in inside):
        return fn({call})
    if sink.device_clock is not None:
        return device_timed(sink, spec, fn, ({call},), {{}})
    try:
        if {tensor} is None:
            sig, nbytes = sink.collective_sig(spec, ({call},), {{}})
        elif {group} is None and {asyn} is False:  # the signature depends on the dtype alone
            nbytes = {tensor}.nbytes
            try:
                sig = sink.fast_sigs[spec][{tensor}.dtype]
            except KeyError:  # the first call of its dtype (since groups were last named)
                sig, nbytes = sink.collective_sig(spec, ({call},), {{}})
                sink.fast_sigs.setdefault(spec, {{}})[{tensor}.dtype] = sig
        else:
            nbytes = {tensor}.nbytes
            key = ({tensor}.dtype, {group}, {asyn})
            try:
                sig = sink.fast_sigs[kw_key][key]
            except KeyError:
                sig, nbytes = sink.collective_sig(spec, ({call},), {{}})
                sink.fast_sigs.setdefault(kw_key, {{}})[key] = sig
    except Exception as e:  # a hook never breaks the call it observes
        sink.hook_error("collective", e)
        return fn({call})
    if mine:
        flag.owner_in = True
    else:
        inside.add(tid)
    sink.pending_sig = sig
    ret = None
    t0 = sink.pending_t0 = clock()
    try:
        ret = fn({call})
        return ret
    finally:
        dur = clock() - t0
        if mine:
            flag.owner_in = False
        else:
            inside.discard(tid)
        sink.pending_sig = -1
        try:
            sink.acc.comm_ns += dur
            # an async call's Work: its row is written at completion (trainer_hooks.integrations.async_done)
            if ret is None or not track(sink, ret, sink.step_n, sink.step_off + t0, t0, nbytes, sig):
                sink.collective_rows.extend((sink.step_n, sink.step_off + t0, dur, nbytes, sig))
        except Exception as e:
            sink.hook_error("collective", e)
'''


def plain_params(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """``fn``'s parameters when every one is positional-or-keyword, else None."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if not params or any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return None
    return params


def make(spec: Any, fn: Callable[..., Any], state: Any, device_timed: Callable[..., Any], kw_key: Any) -> Callable[..., Any] | None:
    """The fast-form wrapper of ``fn`` (None where its parameters do not allow it): ``spec`` names
    one tensor first, no peer, and ``group`` and ``async_op`` parameters."""
    params = plain_params(fn)
    if params is None or spec.kind != "arg" or spec.index != 0 or spec.peer_name:
        return None
    names = [p.name for p in params]
    if "group" not in names or "async_op" not in names or names[0] in ("group", "async_op"):
        return None
    scope: dict[str, Any] = {"state": state, "flag": state.local, "inside": state.local.tids, "get_ident": get_ident, "fn": fn,
                             "spec": spec, "device_timed": device_timed, "kw_key": kw_key,
                             "clock": time.perf_counter_ns, "track": async_done.track}
    decl = []
    for i, p in enumerate(params):
        if p.default is inspect.Parameter.empty:
            decl.append(p.name)
        else:
            scope[f"_default_{i}"] = p.default
            decl.append(f"{p.name}=_default_{i}")
    if any(n in scope for n in names) or any(n in ("sink", "tid", "mine", "sig", "nbytes", "key", "ret", "t0", "dur", "e")
                                             for n in names):
        return None  # a parameter would shadow a name the body uses
    source = _TEMPLATE.format(params=", ".join(decl), call=", ".join(names), tensor=names[0], group="group",
                              asyn="async_op")
    exec(compile(source, f"<tracetop {spec.name} wrapper>", "exec"), scope)  # noqa: S102 (our own template)
    wrapper: Callable[..., Any] = scope["wrapper"]
    return wrapper
