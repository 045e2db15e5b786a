"""What a Tracer hands its rows to: the contract of :class:`tracetop.wire.shipper.Shipper` (and its
``NullShipper``) as the hooks use it, so a test or a relay can pass its own (``Tracer(shipper=...)``).

Optional, read with ``getattr``: ``endpoint`` (where rows go, for messages), ``ship_interval_s``
(the emitter follows it) and ``on_interval_change(fn)`` (called when that interval changes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from tracetop.events import Kind


class RowSink(Protocol):
    def record(self, kind: Kind, *row: Any) -> None:
        """Append one row (columns in ``tracetop.events.SCHEMAS[kind]`` order). Never blocks."""

    def record_many(self, kind: Kind, columns: Mapping[str, Any]) -> None:
        """Queue whole columns as rows (the emitter's drain)."""

    def ship_soon(self) -> None:
        """Send what was recorded so far now, without waiting for acks."""

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Send everything recorded so far and wait for its acks. True if they came."""

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush for up to ``timeout_s``, then stop."""

    def stats(self) -> dict[str, Any]:
        """Counters (``connected``, ``last_error``, ``batches_acked``, ``unacked_batches``, ...)."""
