"""Adjustments applied at a step boundary, on every rank at the same step.

The control path (commands broadcast to all ranks by the hooks) calls these functions; the
trainer's ``--adjust STEP:KEY=VALUE`` flag calls them too, so they can be tested and demonstrated
without a controller. Both are given the same ``Run`` (see ``train.py``).

- ``set_micro_batch``: a new micro-batch size with the global batch kept, through the number of
  micro-batches (gradient accumulation). On the PipelineEngine the cached activation and
  gradient shapes are reset (``reset_activation_shape``), or the next receive would use the old
  buffer size and fail.
- ``set_optimizer_offload``: with ZeRO 1/2 and no configured offload, the optimizer state lives
  in host memory between optimizer steps (``engine.offload_states`` after each step,
  ``reload_states`` right before the next optimizer step; DeepSpeed supports this for ZeRO 1/2
  with torch's Adam). Elsewhere in the ZeRO shape (ZeRO 3, or a run started with ``--offload``):
  checkpoint-and-relaunch, in process: save, build a new engine with the other ZeRO offload
  config, load. ZeRO 0 has nothing to offload and is refused.
- ``set_rebalance``: the samples each data-parallel replica trains per step
  (``trainer_hooks.rebalance.Rebalance``), the global batch kept. Every replica keeps its number of
  micro-batches M. The ZeRO shape cuts its share into M micro-batches whose sizes differ by at most
  one and weights each micro-batch's loss by ``M x dp x size / global batch`` (``engine.backward``
  divides by M): ZeRO 2/3 reduce gradients at every micro-batch, so every replica must run all M.
  The 3D shape (PipelineEngine) runs micro-batches of one size within a pipe (its p2p buffers are
  sized by the first): a share must be a multiple of M, the pipe's micro-batch size becomes
  share / M (``reset_activation_shape`` on every stage of the pipe), and the pipeline's loss is
  weighted by ``dp x share / global batch``. Either way DeepSpeed's average over the replicas gives
  the mean over the global batch: the balanced step's update, and the same loss.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from tracetop.errors import TracetopError


class AdjustError(TracetopError, ValueError):
    """An adjustment that cannot be applied; the message says why and what to do instead."""


@dataclasses.dataclass(frozen=True)
class Adjustment:
    step: int
    key: str  # micro_batch | offload | rebalance
    value: Any


def parse_adjustment(text: str) -> Adjustment:
    m = re.match(r"^(\d+):(\w+)=(\S+)$", text.strip())
    if not m:
        raise AdjustError(f"--adjust {text!r}: expected STEP:KEY=VALUE, e.g. 20:micro_batch=2 or 30:offload=on")
    step, key, value = int(m.group(1)), m.group(2), m.group(3)
    if key == "micro_batch":
        if not value.isdigit() or int(value) < 1:
            raise AdjustError(f"--adjust {text!r}: micro_batch must be a positive integer")
        return Adjustment(step, key, int(value))
    if key == "offload":
        if value not in ("on", "off"):
            raise AdjustError(f"--adjust {text!r}: offload is on or off")
        return Adjustment(step, key, value == "on")
    if key == "rebalance":
        from trainer_hooks.rebalance import Rebalance

        parts = value.split(",")
        if not all(p.isdigit() for p in parts) or len(parts) < 2:
            raise AdjustError(f"--adjust {text!r}: rebalance is the samples of each data-parallel replica, e.g. "
                              "20:rebalance=9,9,9,5")
        counts = tuple(int(p) for p in parts)
        relieved = -1 if len(set(counts)) == 1 else min(range(len(counts)), key=counts.__getitem__)
        return Adjustment(step, key, Rebalance(counts, relieved))
    raise AdjustError(f"--adjust {text!r}: unknown key {key!r}; use micro_batch, offload or rebalance")


def plan_micro_batch(micro_batch: int, micro_batches: int, new_micro_batch: int) -> int:
    """The number of micro-batches that keeps this rank's samples per step; raises if none does."""
    per_rank = micro_batch * micro_batches
    if per_rank % new_micro_batch != 0:
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        raise AdjustError(
            f"micro-batch {new_micro_batch} does not divide the {per_rank} samples each data-parallel rank "
            f"trains per step ({micro_batch} x {micro_batches}); the global batch would change. "
            f"Use one of {divisors}"
        )
    return per_rank // new_micro_batch


def set_micro_batch(run: Any, new_micro_batch: int) -> None:
    """Change the micro-batch size keeping the global batch. Call at a step boundary on all ranks."""
    new_micro_batches = plan_micro_batch(run.micro_batch, run.micro_batches, new_micro_batch)
    engine = run.engine
    global_batch = run.micro_batch * run.micro_batches * run.layout.dp
    engine.set_train_micro_batch_size(new_micro_batch)  # keeps GAS, so the global batch moves...
    engine.set_train_batch_size(global_batch)  # ...and this puts it back through GAS
    if hasattr(engine, "reset_activation_shape"):  # PipelineEngine
        engine.micro_batch_size = new_micro_batch
        engine.reset_activation_shape()
    run.micro_batch, run.micro_batches = new_micro_batch, new_micro_batches


def check_rebalance(r: Any, *, dp: int, micro_batch: int, micro_batches: int, pipelined: bool) -> None:
    """Raises AdjustError when ``r`` (a Rebalance) does not fit this run's replicas and batch."""
    per = micro_batch * micro_batches
    if r.dp != dp:
        raise AdjustError(f"rebalance {list(r.samples)}: {r.dp} counts for {dp} data-parallel replicas; give one each")
    if r.global_batch != per * dp:
        raise AdjustError(f"rebalance {list(r.samples)} sums to {r.global_batch}; the global batch is {per * dp} "
                          f"({dp} x {micro_batch} x {micro_batches}): the update would change")
    if min(r.samples) < micro_batches:
        raise AdjustError(f"rebalance {list(r.samples)}: every replica runs {micro_batches} micro-batches (the same "
                          f"collectives on every rank), so each needs at least {micro_batches} samples")
    if pipelined and any(n % micro_batches for n in r.samples):
        raise AdjustError(f"rebalance {list(r.samples)}: a pipe runs {micro_batches} micro-batches of one size "
                          f"(the pipeline engine's p2p buffers), so each count must be a multiple of {micro_batches}")


def set_rebalance(run: Any, r: Any) -> None:
    """The samples per data-parallel replica ``r`` (a Rebalance; balanced undoes). Call at a step
    boundary on all ranks."""
    pipelined = run.layout.shape == "3d"
    check_rebalance(r, dp=run.layout.dp, micro_batch=run.micro_batch, micro_batches=run.micro_batches,
                    pipelined=pipelined)
    balanced = len(set(r.samples)) == 1
    share = r.share(run.dp_rank)
    if pipelined:
        engine = run.engine
        size = share // run.micro_batches
        engine.set_train_micro_batch_size(size)  # this pipe's engine only: GAS (the schedule) kept
        engine.micro_batch_size = size
        engine.reset_activation_shape()
        run.loss_weight.weight = r.weight(run.dp_rank)
    run.rebalance = None if balanced else r
    tracer = getattr(run.tracing, "tracer", None)
    if tracer is not None:  # this rank's STEP rows count its replica's share
        tracer.samples_per_step = share
        if run.preset.seq_len > 0:
            tracer.tokens_per_step = share * run.preset.seq_len


def offload_method(layout: Any) -> tuple[str | None, str]:
    """How optimizer offload is toggled on this layout: ``("offload_states", "")``,
    ``("relaunch", "")`` (checkpoint, new engine with the other ZeRO offload config, load), or
    ``(None, why)`` when neither applies."""
    if layout.offload == "none" and layout.zero in (1, 2):
        return "offload_states", ""
    if layout.shape == "zero":
        return "relaunch", ""
    return None, (f"ZeRO {layout.zero} has no ZeRO optimizer whose state could move; relaunch with --zero 1 "
                  "(pipeline) or --pp 1 --zero 2/3 (--offload cpu to start offloaded)")


def set_optimizer_offload(run: Any, on: bool) -> None:
    """Optimizer state in host memory, or back on the device. Call at a step boundary on all ranks.

    ZeRO 1/2 without configured offload: ``offload_states`` after every step and ``reload_states``
    right before the next optimizer step (the state is off the device during forward/backward).
    The ZeRO shape otherwise (ZeRO 3, or a run started with --offload): checkpoint and rebuild the
    engine with ``offload_optimizer`` (and for ZeRO 3 ``offload_param``) set to cpu, or removed."""
    method, why = offload_method(run.layout)
    if method is None:
        raise AdjustError(f"optimizer offload {'on' if on else 'off'}: {why}")
    if method == "relaunch":
        offloaded = run.layout.offload != "none"
        if offloaded != on:
            run.rebuild("cpu" if on else "none")
        return
    engine = run.engine
    if not getattr(engine, "_rt_offload_installed", False):
        _install_reload_before_step(engine, run)
    run.offload_states_on = on
    if on:
        offload_now(run)
    elif getattr(run, "states_offloaded", False):
        engine.reload_states()
        run.states_offloaded = False


def offload_now(run: Any) -> None:
    """Move the optimizer state to host memory (after a step, when offload is on)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    if run.offload_states_on and not getattr(run, "states_offloaded", False):
        run.engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params])
        run.states_offloaded = True


def _install_reload_before_step(engine: Any, run: Any) -> None:
    optimizer = engine.optimizer
    step = optimizer.step

    def step_with_reload(*a: Any, **kw: Any) -> Any:
        if getattr(run, "states_offloaded", False):
            engine.reload_states()
            run.states_offloaded = False
        return step(*a, **kw)

    optimizer.step = step_with_reload  # the engines call self.optimizer.step()
    engine._rt_offload_installed = True
