"""The step's loss as a float, without ever synchronizing the device.

A float (or an int) is taken as it is; a CPU tensor is read (no device involved). A CUDA tensor is
left NaN: reading it here, on the training thread, would wait for the device (`.item()` syncs).
(Reading it later, on the emitter after a CUDA event says the value is ready, is the way to carry
GPU losses; not built yet.) `reference_trainer` passes floats, and DeepSpeed's PipelineEngine
returns its loss on the device only on GPU runs.
"""

from __future__ import annotations

import math
from typing import Any


def loss_value(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    if getattr(value, "is_cuda", False) or getattr(getattr(value, "device", None), "type", "cpu") != "cpu":
        return math.nan
    numel = getattr(value, "numel", None)
    if callable(numel):
        return float(value.detach().reshape(-1)[0]) if numel() else math.nan
    return float(value)
