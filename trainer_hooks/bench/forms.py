"""The hot path's fast forms against its general ones, in one process (an A/B the machine's load
moves less than two processes run apart).

The schedule of ``tracetop bench hooks``' microbenchmark (22 pipeline instructions, 18 one-tensor
``all_reduce`` calls on a real ``torch.ones(256)``, the step), in blocks of 300 steps: the fast
forms (``bound_call``'s collective wrapper, the ``(engine, buffer_id)`` handler) and the general
``(*args, **kwargs)`` forms (``wrap_function(..., bound=False)``, ``pipeline.wrap(...,
simple=False)``) in random order, then the hooks off; training-thread CPU (``thread_time_ns``) per
recorded event, on minus off, and each block pair's ratio. No collector (an endpoint nobody listens
on: the rows wait in the shipper)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m trainer_hooks.bench.forms [BLOCKS]
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

SCHEDULE = [*(["LoadMicroBatch", "ForwardPass", "SendActivation"] * 2),
            *(["LoadMicroBatch", "ForwardPass", "SendActivation", "RecvGrad", "BackwardPass"] * 2),
            *(["RecvGrad", "BackwardPass"] * 2), "ReduceGrads", "OptimizerStep"]


def _all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    return None


def _compute(self: Any, buffer_id: int = 0) -> None:
    return None


def main(blocks: int) -> int:
    import torch

    from trainer_hooks.integrations import collectives as colls
    from trainer_hooks.integrations import pipeline as pipeline_mod
    from trainer_hooks.tracer import Tracer

    tensor = torch.ones(256)
    tracer = Tracer(endpoint="127.0.0.1:9", run_id="forms", rank=0, world_size=1, wrap_collectives=False,
                    heartbeat_s=5.0, device="cpu")
    tracer.set_topology({"dp": [(0,)]})
    wrappers = {"fast": colls.wrap_function("all_reduce", _all_reduce),
                "general": colls.wrap_function("all_reduce", _all_reduce, bound=False), "off": _all_reduce}
    current = {"all_reduce": _all_reduce}

    def two(self: Any, buffer_id: int = 0) -> None:  # send/recv: meta + data; reduce: grads + norm
        ar = current["all_reduce"]
        ar(tensor)
        ar(tensor)

    kinds = {"LoadMicroBatch": _compute, "ForwardPass": _compute, "BackwardPass": _compute, "SendActivation": two,
             "RecvGrad": two, "ReduceGrads": two, "OptimizerStep": _compute}
    table = {type(n, (), {}): fn for n, fn in kinds.items()}
    by_name = {cls.__name__: cls for cls in table}

    class Engine:
        _INSTRUCTION_MAP = table

    engine = Engine()
    handlers = {"off": [table[by_name[n]] for n in SCHEDULE]}
    for form, simple in (("fast", True), ("general", False)):
        pipeline_mod.wrap(engine, tracer, simple=simple)
        handlers[form] = [engine._INSTRUCTION_MAP[by_name[n]] for n in SCHEDULE]
    null = Tracer(enabled=False)

    def block(form: str) -> tuple[int, int]:
        on = form != "off"
        t = tracer if on else null
        hs = handlers[form]
        current["all_reduce"] = wrappers[form]
        colls.route_to(tracer.recorder if on else None)
        ev0, c0 = tracer.events, time.thread_time_ns()
        for n in range(300):
            with t.step(n):
                for h in hs:
                    h(engine)
        return time.thread_time_ns() - c0, tracer.events - ev0

    per_event: dict[str, list[float]] = {"fast": [], "general": []}
    try:
        for form in ("fast", "general", "off"):  # warm
            block(form)
        for _ in range(blocks):
            order = ["fast", "general"]
            random.shuffle(order)
            done = {form: block(form) for form in order}
            off, _ = block("off")
            for form, (cpu, events) in done.items():
                per_event[form].append((cpu - off) / max(1, events))
    finally:
        colls.route_to(None)
        tracer.close()
    ratios = [a / b for a, b in zip(per_event["fast"], per_event["general"])]
    print(f"fast {statistics.median(per_event['fast']):.1f} ns/event, general "
          f"{statistics.median(per_event['general']):.1f}; ratio median {statistics.median(ratios):.3f} "
          f"(fast lower in {sum(r < 1 for r in ratios)} of {len(ratios)} blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 40))
