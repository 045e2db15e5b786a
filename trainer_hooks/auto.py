"""The automatic form: a plain loop traced with no ``step`` or ``phase`` blocks.

    import trainer_hooks
    tracer = trainer_hooks.auto(model, optimizer)     # after DDP/FSDP wrapping (or accelerator.prepare)
    for x, y in loader:                               # the loop as it was
        loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
    tracer.close()                                    # optional: exit and SIGTERM flush too

Built on the Tracer's public callback API (``begin_step``, ``switch_phase``, ``end_step``,
``set_loss``, ``close``) and public torch hooks; where each number comes from:

| what | from |
|---|---|
| step boundary | the optimizer's step post-hook (``Optimizer.register_step_post_hook``) ends step n; the next step begins at the next batch fetched or the next forward (gradient accumulation: many forward/backward, one optimizer step, one tracetop step) |
| data | ``next()`` on any ``torch.utils.data.DataLoader`` iterator (``_BaseDataLoaderIter.__next__``, patched on the class, restored on close) while the model is in training mode |
| forward | the model's forward pre/post hooks (the outermost module given: DDP, FSDP or plain) |
| backward | ``Tensor.backward`` (patched, restored on close): from its call to its return, DDP's exposed all-reduce wait included as with ``phase("backward")`` |
| optimizer | the optimizer's step pre-hook to its post-hook |
| loss | the scalar ``backward()`` is called on (the loss as the loop scaled it: divided by the accumulation steps under Accelerate, times the scale under a GradScaler); a CUDA tensor is copied without a sync (trainer_hooks/loss.py) |

Only the thread that called ``auto`` is traced (a prefetching thread's ``next()`` is not data
wait of the training loop). The loss computed between the model's output and ``backward()``
(``loss_fn``) is in no phase; with the explicit API it is usually inside ``phase("forward")``:
a few microseconds on the step; so is ``zero_grad()`` after the optimizer's step (no step holds it).
A step whose optimizer step is skipped (a GradScaler's inf
step) runs on into the next one. Telemetry never breaks the loop: a hook that raises is
counted (``errors``), logged once, and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from trainer_hooks.tracer import Tracer

log = logging.getLogger("trainer_hooks")

#: the Auto tracers alive in this process (the class-level patches dispatch to them)
_ACTIVE: list[Auto] = []
_PATCHED: dict[str, Any] = {}


def auto(model: Any, optimizer: Any, *, tracer: Tracer | None = None, start_step: int = 0,
         **tracer_kwargs: Any) -> Auto:
    """Trace ``model``'s training loop with ``optimizer``: returns an :class:`Auto` (``close()``,
    ``tracer``, a context manager). ``tracer`` or Tracer keyword arguments (``tokens_per_step``,
    ``flops_per_token``, ...). Call it after wrapping the model (DDP, FSDP, ``accelerator.prepare``)."""
    return Auto(model, optimizer, tracer=tracer if tracer is not None else Tracer(**tracer_kwargs),
                start_step=start_step)


def _inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that runs the step hooks: Accelerate's ``AcceleratedOptimizer`` (and
    similar wrappers) hold it as ``.optimizer`` and call its ``step`` only on a synchronizing step."""
    seen = 0
    while hasattr(optimizer, "optimizer") and hasattr(optimizer.optimizer, "register_step_post_hook") and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    if not hasattr(optimizer, "register_step_post_hook"):
        raise TypeError(f"trainer_hooks.auto: {type(optimizer).__name__} is not a torch.optim.Optimizer (it has no "
                        f"register_step_post_hook); pass the optimizer whose step() ends a training step, or use "
                        f"the explicit tracer.step()/tracer.phase() API")
    return optimizer


class Auto:
    """One model and optimizer traced through hooks. ``step_n``: the step being (or next to be) recorded."""

    def __init__(self, model: Any, optimizer: Any, *, tracer: Tracer, start_step: int = 0) -> None:
        if not hasattr(model, "register_forward_pre_hook"):
            raise TypeError(f"trainer_hooks.auto: {type(model).__name__} is not a torch.nn.Module; pass the model "
                            f"the loop calls (after DDP/FSDP wrapping)")
        self.tracer = tracer
        self.model = model
        self.step_n = start_step
        self.errors = 0
        #: False: every hook passes through, nothing is recorded (a step left open stays open)
        self.enabled = True
        self._open = False  # a tracetop step begun and not yet ended
        self._thread = threading.get_ident()
        self._closed = False
        opt = _inner_optimizer(optimizer)
        self._handles = [
            model.register_forward_pre_hook(self._forward_pre),
            model.register_forward_hook(self._forward_post),
            opt.register_step_pre_hook(self._optimizer_pre),
            opt.register_step_post_hook(self._optimizer_post),
        ]
        _ACTIVE.append(self)
        _install_patches()

    # ------------------------------------------------------------------ events
    def _ours(self) -> bool:
        return self.enabled and not self._closed and threading.get_ident() == self._thread

    def _begin(self) -> None:
        if not self._open:
            self._open = True
            self.tracer.begin_step(self.step_n)

    def _training(self) -> bool:
        return bool(getattr(self.model, "training", True))

    def data_begin(self) -> bool:
        """A DataLoader's next(): True if it is timed as this loop's data wait."""
        if not self._ours() or not (self._open or self._training()):
            return False
        try:
            self._begin()
            self.tracer.switch_phase("data")
            return True
        except Exception as e:
            self._error("data", e)
            return False

    def phase_end(self) -> None:
        try:
            self.tracer.switch_phase(None)
        except Exception as e:
            self._error("phase", e)

    def _forward_pre(self, _module: Any, _args: Any) -> None:
        if not self._ours() or not self._training():
            return
        try:
            self._begin()
            self.tracer.switch_phase("forward")
        except Exception as e:
            self._error("forward", e)

    def _forward_post(self, _module: Any, _args: Any, _out: Any) -> None:
        if self._ours() and self._open:
            self.phase_end()

    def backward_begin(self, loss: Any) -> bool:
        if not self._ours() or not self._training():
            return False
        try:
            self._begin()
            self.tracer.switch_phase("backward")
            numel = getattr(loss, "numel", None)
            if callable(numel) and numel() == 1:
                self.tracer.set_loss(loss)  # loss_value reads a CPU scalar, copies a CUDA one without a sync
            return True
        except Exception as e:
            self._error("backward", e)
            return False

    def _optimizer_pre(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        if not self._ours():
            return
        try:
            self._begin()
            self.tracer.switch_phase("optimizer")
        except Exception as e:
            self._error("optimizer", e)

    def _optimizer_post(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        if not self._ours() or not self._open:
            return
        try:
            self.tracer.end_step()  # leaves the optimizer phase too
        except Exception as e:
            self._error("step", e)
        self._open = False
        self.step_n += 1

    def _error(self, where: str, e: Exception) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("trainer_hooks.auto: a %s hook raised %r; counted and skipped (this is logged once)", where, e)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Remove the hooks (and the patches, with the last Auto), then ``tracer.close()``. A step
        begun and not ended (a last fetch that found the loader empty) is not recorded. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if not _ACTIVE:
            _remove_patches()
        self.tracer.close()

    def __enter__(self) -> Auto:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------- class-level patches
def _install_patches() -> None:
    if _PATCHED:
        return
    import torch
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    orig_next = _BaseDataLoaderIter.__next__
    orig_backward = torch.Tensor.backward

    def __next__(self: Any) -> Any:
        timed = [a for a in _ACTIVE if a.data_begin()]
        try:
            return orig_next(self)
        finally:
            for a in timed:
                a.phase_end()

    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        timed = [a for a in _ACTIVE if a.backward_begin(self)]
        try:
            return orig_backward(self, *args, **kwargs)
        finally:
            for a in timed:
                a.phase_end()

    _PATCHED["next"] = (_BaseDataLoaderIter, "__next__", orig_next)
    _PATCHED["backward"] = (torch.Tensor, "backward", orig_backward)
    _BaseDataLoaderIter.__next__ = __next__
    torch.Tensor.backward = backward


def _remove_patches() -> None:
    for cls, name, orig in _PATCHED.values():
        setattr(cls, name, orig)
    _PATCHED.clear()
