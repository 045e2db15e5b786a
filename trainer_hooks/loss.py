"""The step's loss, without ever synchronizing the device on the training thread.

The Tracer keeps what ``set_loss`` is given and calls :func:`loss_value` once, at the step's end,
on the last value (a tensor replaced before then is never read). A float (or an int) is taken as
it is; a CPU tensor is read then (``item()``: no device involved). A CUDA tensor is never read here (`.item()` waits for the device): with the tracer's
device clock the value is copied to pinned host memory asynchronously (`to("cpu", non_blocking=True)` on the
current stream) and the copy is read by the emitter once the step's end event, recorded after
it on the same stream, says the device got there (`resolve`). Without a device clock (CPU timers
on a GPU tensor) it stays NaN.
"""

from __future__ import annotations

import math
from typing import Any


def loss_value(value: Any, *, deferred: bool = False) -> Any:
    """A float, or (deferred, a device tensor) a pending host copy for `resolve` to read later."""
    if value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    # a torch tensor says is_cpu in one attribute read (reading .device builds a torch.device: ~15 us
    # cold on the training thread); anything else: its device's type
    is_cpu = getattr(value, "is_cpu", None)
    if is_cpu is None:
        on_device = getattr(value, "is_cuda", False) or getattr(getattr(value, "device", None), "type", "cpu") != "cpu"
    else:
        on_device = not is_cpu
    if on_device:
        if not deferred:
            return math.nan
        return value.detach().reshape(-1)[:1].to("cpu", non_blocking=True)
    numel = getattr(value, "numel", None)
    if callable(numel):
        # one C call: detach().reshape(-1)[0] made three tensors and cost ~70 us a step on the
        # training thread of the reference trainer (cold caches between steps), item() ~1-8 us
        n = numel()
        if n == 1:
            return float(value.item())
        return float(value.reshape(-1)[0].item()) if n else math.nan
    return float(value)


def resolve(loss: Any) -> float:
    """The float of what loss_value returned; a pending copy only once its step's end event is done."""
    if isinstance(loss, float):
        return loss
    try:
        return float(loss[0]) if len(loss) else math.nan
    except Exception:
        return math.nan
