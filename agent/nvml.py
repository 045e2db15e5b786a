"""The NVML funnel: every NVML call the agent makes goes through `NVML.query`.

Modelled on nvitop's `libnvml.nvmlQuery`:
- the backend is a module-like object with pynvml's names (the real `pynvml` by default,
  `agent.fake_nvml.FakeNVML` in tests and demos);
- at run time a field the GPU or driver does not support (NotSupported, FunctionNotFound, ...)
  becomes `None` (stored as NULL), logged once per (device, field); any other NVML error is also
  turned into `None` and logged once, because telemetry never throws into its host;
- only setup (`NVML.start`) raises, with `NVMLUnavailable` whose message carries a HINT.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from tracetop.errors import TracetopError

log = logging.getLogger("tracetop.agent.nvml")

#: Error class names (pynvml's) that mean "this GPU/driver does not have that": expected, quiet.
_UNSUPPORTED = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission")


#: nvmlValueType_t -> the member of c_nvmlValue_t holding it.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class NVMLUnavailable(TracetopError, RuntimeError):
    """NVML could not be started (no library, no driver, no GPU). str() ends with a HINT."""

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(f"{reason}; HINT: {hint}")
        self.reason = reason
        self.hint = hint


def _default_backend() -> Any:
    import pynvml

    return pynvml


def _hint_for(err: BaseException) -> tuple[str, str]:
    name = type(err).__name__
    if name == "NVMLError_LibraryNotFound":
        return (
            "libnvidia-ml.so.1 not found",
            "install the NVIDIA driver (it ships libnvidia-ml.so.1) or run on a node with GPUs",
        )
    if name == "NVMLError_DriverNotLoaded":
        return (
            "the NVIDIA driver is not loaded",
            "load the kernel module (nvidia-smi should work) and restart",
        )
    if name == "NVMLError_NoPermission":
        return ("no permission to open the GPU devices", "run the agent as a user that can read /dev/nvidia*")
    if name == "NVMLError_LibRmVersionMismatch":
        return ("NVML and driver versions differ", "reboot or reload the driver after an upgrade")
    return (
        f"NVML init failed: {name}: {err}",
        "check `nvidia-smi`; the agent samples host metrics meanwhile",
    )


class NVML:
    """One NVML session. `query(fn, *args)` is the only way calls reach the backend."""

    def __init__(self, backend: Any = None) -> None:
        self.backend = backend if backend is not None else _default_backend()
        self._error_base: type[BaseException] = getattr(self.backend, "NVMLError", Exception)
        self._logged: set[tuple[str, int]] = set()
        self._index_of: dict[int, int] = {}  # id(handle) -> device index, for log messages
        self._lock = threading.Lock()
        self.handles: list[Any] = []
        self.started = False

    # ---- setup: raises ----
    def start(self) -> list[Any]:
        """nvmlInit + one handle per device. Raises NVMLUnavailable with a HINT."""
        try:
            self.backend.nvmlInit()
            count = int(self.backend.nvmlDeviceGetCount())
            handles = [self.backend.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except self._error_base as e:
            reason, hint = _hint_for(e)
            raise NVMLUnavailable(reason, hint) from e
        except OSError as e:  # a broken install can surface as a raw OSError
            raise NVMLUnavailable(f"NVML could not be loaded ({e})", "reinstall the NVIDIA driver") from e
        self.handles = handles
        self._index_of = {id(h): i for i, h in enumerate(handles)}
        self.started = True
        return handles

    def stop(self) -> None:
        if self.started:
            self.started = False
            self.query("nvmlShutdown")

    # ---- run time: never raises NVML errors ----
    def query(
        self,
        fn: str | Callable[..., Any],
        *args: Any,
        default: Any = None,
        passthrough: tuple[type, ...] = (),
    ) -> Any:
        """Call `fn` (a backend function or its name) with args. NVML errors -> `default` (None),
        logged once per (function, device); the first argument, if it is a device handle, names
        the device. Errors of the `passthrough` types are raised instead (an event wait's Timeout)."""
        if isinstance(fn, str):
            func = getattr(self.backend, fn, None)
            if func is None:  # an older pynvml without this binding: like NVML's FunctionNotFound
                self._log_once(fn, args[0] if args else None, AttributeError(f"this pynvml has no {fn}"))
                return default
        else:
            func = fn
        try:
            return func(*args)
        except self._error_base as e:
            if passthrough and isinstance(e, passthrough):
                raise
            self._log_once(getattr(func, "__name__", str(func)), args[0] if args else None, e)
            return default

    def field_values(self, handle: Any, field_ids: list[Any]) -> list[float | None]:
        """Batched nvmlDeviceGetFieldValues; each entry a float or None (its own nvmlReturn failed,
        logged once per (field, device)). `field_ids` items: an id, or (id, scope id)."""
        values = self.query("nvmlDeviceGetFieldValues", handle, field_ids)
        if values is None:
            return [None] * len(field_ids)
        out: list[float | None] = []
        for fid, v in zip(field_ids, values):
            if v.nvmlReturn != 0:  # NVML_SUCCESS
                err = self.backend.NVMLError(v.nvmlReturn)
                self._log_once(f"field {fid}", handle, err)
                out.append(None)
            else:
                out.append(float(getattr(v.value, _VALUE_MEMBER.get(v.valueType, "ullVal"))))
        return out

    def _log_once(self, name: str, handle: Any, err: BaseException) -> None:
        device = self._index_of.get(id(handle), -1) if handle is not None else -1
        key = (name, device)
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        where = f"GPU {device}" if device >= 0 else "NVML"
        if type(err).__name__ in _UNSUPPORTED:
            log.info("%s: %s not supported (%s); reporting it as null", where, name, err)
        else:
            log.warning("%s: %s failed (%s: %s); reporting it as null", where, name, type(err).__name__, err)

    def unsupported(self) -> list[tuple[str, int]]:
        """(function, device) pairs that have returned null so far."""
        with self._lock:
            return sorted(self._logged)
