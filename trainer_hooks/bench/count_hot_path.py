"""Instructions the hooks run on the training thread, counted by callgrind (repeatable whatever
the machine's load; docs/benchmarks.md, "Issue 28"). The measured steps run inside
``sum(map(step, ...))`` so that ``--toggle-collect=builtin_sum`` counts them alone; a stand-in
tensor (no torch), a NullShipper, 50 warm steps first. MODE: ``micro`` (the schedule of
``tracetop bench hooks``' microbenchmark: 22 instructions, 18 one-tensor collectives),
``ref`` (a reference-trainer step: 15 instructions called with ``buffer_id=``, 2 collectives called
as DeepSpeed's comm backend calls them, every argument a keyword, two ``set_loss``, the command seam) or ``stepctx`` (the step alone), each ``-on`` or ``-off``::

    DS_ACCELERATOR=cpu PYTHONHASHSEED=0 valgrind --tool=callgrind --collect-atstart=no \
        --toggle-collect=builtin_sum --callgrind-out-file=/tmp/cg.out \
        .venv/bin/python -m trainer_hooks.bench.count_hot_path micro-on 300
    grep '^summary:' /tmp/cg.out    # minus the same with micro-off, over the rows it prints
"""
from __future__ import annotations

import sys
from typing import Any


class _Tensor:
    """A one-element CPU tensor, as far as the hooks look at it."""

    nbytes = 1024
    dtype = "float32"
    is_cpu = True

    def numel(self) -> int:
        return 1

    def item(self) -> float:
        return 2.5


def _all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    return None


def _compute(self: Any, buffer_id: int = 0) -> None:
    return None


def _no_argument(self: Any) -> None:
    return None


def _optimizer_step(self: Any, lr_kwargs: Any = None) -> None:
    return None


MICRO = [*(["LoadMicroBatch", "ForwardPass", "SendActivation"] * 2),
         *(["LoadMicroBatch", "ForwardPass", "SendActivation", "RecvGrad", "BackwardPass"] * 2),
         *(["RecvGrad", "BackwardPass"] * 2), "ReduceGrads", "OptimizerStep"]
#: the reference trainer with pp 1 and 4 micro-batches; its 2 all_reduce calls inside ReduceGrads
REF = [*(["LoadMicroBatch", "ForwardPass", "BackwardPass"] * 4), "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]


def main(mode: str, steps: int) -> int:
    from reference_trainer.tracing import Traced
    from tracetop.wire.shipper import NullShipper
    from trainer_hooks.integrations import collectives as colls
    from trainer_hooks.integrations import pipeline as pipeline_mod
    from trainer_hooks.tracer import Tracer

    tensor, loss = _Tensor(), _Tensor()
    t = Tracer(run_id="count", rank=0, world_size=1, wrap_collectives=False, shipper=NullShipper(),
               heartbeat_s=1e6, drain_interval_s=1e6, device="cpu")
    t.set_topology({"dp": [(0,)]})
    traced = Traced(t)
    timed_all_reduce = colls.wrap_function("all_reduce", _all_reduce)
    current = {"all_reduce": _all_reduce}

    def two_collectives(self: Any, buffer_id: int = 0) -> None:
        current["all_reduce"](tensor)
        current["all_reduce"](tensor)

    def reduce_grads(self: Any) -> None:  # deepspeed/comm/torch.py: every argument a keyword
        current["all_reduce"](tensor=tensor, op=None, group=None, async_op=False)
        current["all_reduce"](tensor=tensor, op=None, group=None, async_op=False)

    kinds = {"LoadMicroBatch": _compute, "ForwardPass": _compute, "BackwardPass": _compute,
             "SendActivation": two_collectives, "RecvGrad": two_collectives, "ReduceGrads": two_collectives,
             "OptimizerStep": _compute, "ReduceTiedGrads": _compute}
    if mode.startswith("ref"):  # DeepSpeed's handlers' signatures
        kinds.update(ReduceGrads=reduce_grads, ReduceTiedGrads=_no_argument, OptimizerStep=_optimizer_step)
    table = {type(name, (), {}): fn for name, fn in kinds.items()}

    class Engine:
        _INSTRUCTION_MAP = table

    engine = Engine()
    pipeline_mod.wrap(engine, t)
    by_name = {cls.__name__: cls for cls in table}
    on = mode.endswith("-on")
    reference = mode.startswith(("ref", "stepctx"))
    schedule = MICRO if mode.startswith("micro") else REF if mode.startswith("ref") else []
    # DeepSpeed's calls: ``handler(engine, buffer_id=i)``, ``handler(engine)`` for ReduceGrads,
    # ReduceTiedGrads and OptimizerStep (their commands carry no keyword)
    no_kw = ("ReduceGrads", "ReduceTiedGrads", "OptimizerStep")
    handlers = [((engine._INSTRUCTION_MAP if on else table)[by_name[n]],  # type: ignore[attr-defined]
                 {} if n in no_kw and reference else {"buffer_id": 0}) for n in schedule]
    current["all_reduce"] = timed_all_reduce if on else _all_reduce
    colls.route_to(t.recorder if on else None)
    tr = t if on else Tracer(enabled=False)

    def step(n: int) -> int:
        if on and reference:
            traced.adjustments(n)
        with tr.step(n):
            for h, kw in handlers:
                h(engine, **kw)
            if reference:
                tr.set_loss(loss)
                tr.set_loss(2.5)
        return 0

    for n in range(50):  # warm: signatures, caches
        step(n)
    rows0 = t.events
    sum(map(step, range(50, 50 + steps)))  # the counted part (--toggle-collect=builtin_sum)
    print("rows", t.events - rows0)
    colls.route_to(None)
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
