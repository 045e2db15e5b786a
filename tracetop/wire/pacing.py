"""How often a shipper ships: its own interval, or the shorter one its receiver asks for.

While someone watches a run (a Query.Watch stream, the TUI), the collector's ``Ingest.Push``
replies carry ``ship_interval_s`` (TRACETOP_FRESH_SHIP_S); the shipper then seals at that pace and
tells its listeners (the hooks' emitter, which buffers rows itself), and goes back to its own
``flush_interval_s`` once nobody watches (the replies ask 0). Plain state: the sender thread asks,
the flusher and the producers read.
"""

from __future__ import annotations

from collections.abc import Callable


class Pacing:
    """Args:
        flush_interval_s: the shipper's own interval.
        on_change: called (on the asking thread) when the interval changed: wake the flusher.
        warn_once: ``(key, message)``, for a listener that raised.
    """

    def __init__(self, flush_interval_s: float, on_change: Callable[[], None],
                 warn_once: Callable[[str, str], None]) -> None:
        self.flush_interval_s = flush_interval_s
        self._on_change = on_change
        self._warn_once = warn_once
        self._asked_s = 0.0  # the receiver's freshness request; 0: none
        self._listeners: list[Callable[[], None]] = []

    @property
    def interval_s(self) -> float:
        """Seconds between shipments now: flush_interval_s, or the shorter interval asked for."""
        asked = self._asked_s
        return min(asked, self.flush_interval_s) if asked > 0 else self.flush_interval_s

    @property
    def asked_s(self) -> float:
        """The receiver's latest request (0: none); a relay passes it on to its hooks."""
        return self._asked_s

    def listen(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (it must not block) whenever the interval changes."""
        self._listeners.append(fn)

    def ask(self, interval_s: float) -> None:
        """The receiver asked for ``interval_s`` (a Push reply's ship_interval_s; 0: none)."""
        if interval_s != self._asked_s and interval_s >= 0:
            self._asked_s = interval_s
            self._on_change()  # the flusher may be asleep for a whole (longer) interval
            for fn in self._listeners:
                try:
                    fn()
                except Exception as e:  # a listener never stops the sender
                    self._warn_once("interval-listener", f"tracetop: interval listener failed: {e!r}")
