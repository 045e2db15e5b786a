"""The control path's place in the collector: the service, and its loops on the event loop
(the lost-command sweep every second; the controller, when its mode is not off)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from collector.control.service import DEFAULT_TTL_S, ControlService, ControlServicer

log = logging.getLogger("tracetop.collector")


def make_service(con: Any, ttl_s: float | None) -> tuple[ControlService, ControlServicer]:
    service = ControlService(con, ttl_s=ttl_s if ttl_s else DEFAULT_TTL_S)
    return service, ControlServicer(service)


async def _sweep(service: ControlService, every_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            service.sweep()
        except Exception:
            log.exception("collector: lost-command sweep failed")


async def _control(controller: Any, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(controller.gather)  # the adapter's SQL, off the loop
            controller.decide_and_act()
        except Exception:
            log.exception("collector: controller tick failed")


class AlertOut:
    """Where the controller's own alerts (``controller_cannot_fix``) go: the live engine's book,
    `alerts` table and sinks where the engine runs (``LiveEngine.raise_alert``), else straight to
    the export sinks (Alertmanager, webhook; OTLP reads the engine's alerts, so it needs the engine)."""

    def __init__(self, live: Any = None, sinks: Sequence[Any] = ()) -> None:
        self.live = live
        self.sinks = list(sinks)

    def publish(self, changed: Sequence[Any], firing: Sequence[Any]) -> None:
        if self.live is not None:
            for a in changed:
                self.live.raise_alert(a)
            return
        for s in self.sinks:
            try:
                s.publish(changed, firing)
            except Exception:
                log.exception("collector: alert sink %r failed", s)


def start_tasks(service: ControlService, con: Any, controller: Any, *, live: Any = None,
                sinks: Sequence[Any] = ()) -> list[asyncio.Task]:
    """``controller``: None (off), or a ``collector.control.controller.ControllerSettings``;
    ``live``: the live engine (None: off); ``sinks``: the alert sinks the engine would feed."""
    tasks = [asyncio.ensure_future(_sweep(service))]
    if controller is not None and getattr(controller, "mode", "off") != "off":
        from collector.control.controller import Controller
        from collector.control.inputs import RowInputs
        from collector.control.live_inputs import EngineInputs

        # the live engine's state where it runs; the committed rows where it is off (--no-rules)
        source = EngineInputs(live, con) if live is not None else RowInputs(con)
        c = Controller(service, source, controller, alert_sink=AlertOut(live, sinks))
        tasks.append(asyncio.ensure_future(_control(c, controller.tick_s)))
    return tasks
