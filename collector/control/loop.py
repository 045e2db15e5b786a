"""The control path's place in the collector: the service, and its loops on the event loop
(the lost-command sweep every second; the controller, when its mode is not off)."""

from __future__ import annotations

import asyncio
import logging
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


def start_tasks(service: ControlService, con: Any, controller: Any) -> list[asyncio.Task]:
    """``controller``: None (off), or a ``collector.control.controller.ControllerSettings``."""
    tasks = [asyncio.ensure_future(_sweep(service))]
    if controller is not None and getattr(controller, "mode", "off") != "off":
        from collector.control.controller import Controller
        from collector.control.inputs import RowInputs

        c = Controller(service, RowInputs(con), controller)
        tasks.append(asyncio.ensure_future(_control(c, controller.tick_s)))
    return tasks
