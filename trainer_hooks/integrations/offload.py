"""Offload traffic of DeepSpeed's ZeRO optimizers, from the named methods that move it.

Instance attributes shadow the optimizer's methods (DeepSpeed is not edited); :func:`unwrap`
removes them. Bytes come from the tensors each method copies (DeepSpeed 0.19.8, fp32 master
weights; ``shared/notes/deepspeed-instrumentation.md`` §3-4):

ZeRO-1/2 with ``offload_optimizer``:
* ``async_inplace_copy_grad_to_fp32_buffer_from_gpu(param)``: d2h grads, the param's slice of
  this rank's partition (``grad_position`` numel x master dtype).
* ``async_accumulate_grad_in_cpu_via_gpu(param)`` (gradient accumulation): d2h grads of the whole
  param (numel x its dtype) every micro-step, and h2d of the same when ``micro_step_id > 0``.
* ``step``: after each group's optimizer step the updated partition goes back, h2d params
  (``parallel_partitioned_bit16_groups[g][partition_id]``), timed from the end of
  ``_optimizer_step(g)`` to ``_release_preflattened_grad_buffers(g)``.
* ``offload_states`` / ``reload_states``: d2h / h2d of the high-precision partition (params), the
  flat low-precision params (params) and the optimizer states (optim_state).

ZeRO-3 with ``offload_optimizer``: ``_offload_grad_partition_at_boundary``: d2h (h2nvme when the
subgroup is swapped) grads, grad_buffer numel x master dtype. The parameter fetch of ZeRO-3
``offload_param`` (``ds_tensor.to(device)`` inside the all-gather) is not recorded here.

Not covered: the compact gradient-partition path of bf16/fp16 models with an fp32 accumulation
dtype (``copy_grads_in_partition`` copies inline there).
"""

from __future__ import annotations

import functools
from typing import Any

from trainer_hooks.recorder import perf_counter_ns
from trainer_hooks.tracer import Tracer

#: the optimizer attribute listing the methods wrapped on it
WRAPPED_ATTR = "_tracetop_offload_wrapped"


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if t is not None else 0


def wrap(optimizer: Any, tracer: Tracer) -> list[str]:
    """Instrument a ZeRO optimizer that offloads; returns the method names wrapped."""
    if optimizer is None or not tracer.enabled or getattr(optimizer, WRAPPED_ATTR, None):
        return []
    done: list[str] = []
    cls_name = type(optimizer).__name__
    if getattr(optimizer, "cpu_offload", False) and cls_name.startswith("DeepSpeedZeroOptimizer") and cls_name != "DeepSpeedZeroOptimizer_Stage3":
        done += _wrap_stage12(optimizer, tracer)
    if cls_name == "DeepSpeedZeroOptimizer_Stage3" and getattr(optimizer, "offload_optimizer", False):
        done += _wrap_stage3(optimizer, tracer)
    done += _wrap_states(optimizer, tracer)
    setattr(optimizer, WRAPPED_ATTR, done)
    return done


def unwrap(optimizer: Any) -> None:
    for name in getattr(optimizer, WRAPPED_ATTR, None) or []:
        optimizer.__dict__.pop(name, None)
    if optimizer is not None and WRAPPED_ATTR in getattr(optimizer, "__dict__", {}):
        delattr(optimizer, WRAPPED_ATTR)


def _guard(tracer: Tracer, fn: Any) -> Any:
    """Run a recorder; a failure is counted, never raised."""
    try:
        fn()
    except Exception as e:
        tracer.recorder.hook_error("offload", e)


def _wrap_stage12(opt: Any, tracer: Tracer) -> list[str]:
    rec = tracer.record_offload
    orig_copy = opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu
    orig_acc = opt.async_accumulate_grad_in_cpu_via_gpu
    orig_opt_step = opt._optimizer_step
    orig_release = opt._release_preflattened_grad_buffers
    marks: dict[int, int] = {}

    @functools.wraps(orig_copy)
    def copy_grad(param: Any) -> Any:
        t0 = perf_counter_ns()
        out = orig_copy(param)

        def note() -> None:
            i, _, _, num_elements = opt.grad_position[opt.get_param_id(param)]
            item = opt.single_partition_of_fp32_groups[i].element_size()
            rec("d2h", "grads", num_elements * item, t0, perf_counter_ns() - t0)

        _guard(tracer, note)
        return out

    @functools.wraps(orig_acc)
    def accumulate(param: Any) -> Any:
        h2d_too = getattr(opt, "micro_step_id", 0) > 0
        t0 = perf_counter_ns()
        out = orig_acc(param)

        def note() -> None:
            dur = perf_counter_ns() - t0
            if getattr(opt, "low_precision_master_weights_and_grads", False):
                i, _, _, num_elements = opt.grad_position[opt.get_param_id(param)]
                nbytes = num_elements * opt.single_partition_of_fp32_groups[i].element_size()
            else:
                nbytes = param.numel() * param.element_size()
            if h2d_too:
                rec("h2d", "grads", nbytes, t0, dur // 2)
                rec("d2h", "grads", nbytes, t0 + dur // 2, dur - dur // 2)
            else:
                rec("d2h", "grads", nbytes, t0, dur)

        _guard(tracer, note)
        return out

    @functools.wraps(orig_opt_step)
    def optimizer_step(group_no: int, *a: Any, **kw: Any) -> Any:
        out = orig_opt_step(group_no, *a, **kw)
        marks[group_no] = perf_counter_ns()
        return out

    @functools.wraps(orig_release)
    def release(group_idx: Any = None, *a: Any, **kw: Any) -> Any:
        t0 = marks.pop(group_idx, None) if group_idx is not None else None
        if t0 is not None:
            def note() -> None:
                dur = perf_counter_ns() - t0
                pid = _partition_id(opt, group_idx)
                part = opt.parallel_partitioned_bit16_groups[group_idx][pid]
                rec("h2d", "params", _nbytes(part), t0, dur)

            _guard(tracer, note)
        return orig_release(group_idx, *a, **kw)

    opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu = copy_grad
    opt.async_accumulate_grad_in_cpu_via_gpu = accumulate
    opt._optimizer_step = optimizer_step
    opt._release_preflattened_grad_buffers = release
    return ["async_inplace_copy_grad_to_fp32_buffer_from_gpu", "async_accumulate_grad_in_cpu_via_gpu",
            "_optimizer_step", "_release_preflattened_grad_buffers"]


def _partition_id(opt: Any, group: int) -> int:
    cache = opt.__dict__.setdefault("_tracetop_partition_ids", {})
    pid = cache.get(group)
    if pid is None:
        import torch.distributed as dist

        pid = cache[group] = dist.get_rank(group=opt.real_dp_process_group[group])
    return pid


def _wrap_stage3(opt: Any, tracer: Tracer) -> list[str]:
    orig = opt._offload_grad_partition_at_boundary
    rec = tracer.record_offload

    @functools.wraps(orig)
    def offload_grad(param: Any, grad_buffer: Any, *a: Any, **kw: Any) -> Any:
        t0 = perf_counter_ns()
        out = orig(param, grad_buffer, *a, **kw)

        def note() -> None:
            i = opt.grad_position[opt.get_param_id(param)][0]
            nvme = bool(opt._swappable_optimizer_subgroup(i))
            item = opt.fp32_partitioned_groups_flat[i].element_size() if not nvme else 4
            rec("h2nvme" if nvme else "d2h", "grads", grad_buffer.numel() * item, t0, perf_counter_ns() - t0)

        _guard(tracer, note)
        return out

    opt._offload_grad_partition_at_boundary = offload_grad
    return ["_offload_grad_partition_at_boundary"]


def _state_sizes(opt: Any, include: Any = None) -> dict[str, int]:
    """Bytes offload_states moves per kind of state, read from the partitions (ZeRO-1/2):
    hp_params (this rank's fp32 partition) and lp_params (the flat low-precision parameters) are
    ``params``, optim_states (exp_avg, exp_avg_sq, ...) is ``optim_state``. ``include``: the
    states asked for (OffloadStateTypeEnum members or their names); None: all of them. lp_grads
    and the contiguous gradient buffer are not counted."""
    names = None if include is None else {str(getattr(s, "value", s)) for s in include}
    sizes = {"params": 0, "optim_state": 0}
    if names is None or "hp_params" in names:
        sizes["params"] += sum(_nbytes(g) for g in getattr(opt, "single_partition_of_fp32_groups", []) or [])
    if names is None or "lp_params" in names:
        sizes["params"] += sum(_nbytes(g) for g in getattr(opt, "bit16_groups_flat", []) or [])
    if names is None or "optim_states" in names:
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            for v in state.values():
                if hasattr(v, "numel") and v.dim() > 0:
                    sizes["optim_state"] += _nbytes(v)
    return sizes


def _wrap_states(opt: Any, tracer: Tracer) -> list[str]:
    """offload_states (d2h) / reload_states (h2d): bytes of the states moved (reload: the states
    the last offload moved)."""
    done = []
    moved_last: dict[str, int] = {}
    for name, direction in (("offload_states", "d2h"), ("reload_states", "h2d")):
        orig = getattr(opt, name, None)
        if orig is None:
            continue

        def make(orig: Any = orig, direction: str = direction) -> Any:
            @functools.wraps(orig)
            def moved(*a: Any, **kw: Any) -> Any:
                sizes: dict[str, int] = {}
                if direction == "d2h":
                    include = kw.get("include", a[0] if a else None)
                    _guard(tracer, lambda: sizes.update(_state_sizes(opt, include)))
                    moved_last.clear()
                    moved_last.update(sizes)
                else:
                    sizes.update(moved_last)
                    moved_last.clear()
                t0 = perf_counter_ns()
                out = orig(*a, **kw)

                def note() -> None:
                    dur = perf_counter_ns() - t0
                    for what, nbytes in sizes.items():
                        if nbytes:
                            tracer.record_offload(direction, what, nbytes, t0, dur)

                _guard(tracer, note)
                return out

            return moved

        setattr(opt, name, make())
        done.append(name)
    return done
