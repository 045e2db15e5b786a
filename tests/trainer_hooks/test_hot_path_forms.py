"""The hot path's shortcuts give the rows the general path gives: a collective called with
keywords (DeepSpeed's comm backend) against the same call positional, the cache renamed with the
groups, and the flat row buffers drained into the same columns."""

from __future__ import annotations

import pytest

from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport
from trainer_hooks import Tracer
from trainer_hooks.integrations import collectives as colls

torch = pytest.importorskip("torch")


def _all_reduce(tensor, op=None, group=None, async_op=False):
    return None


def test_keyword_and_positional_collective_calls_give_the_same_rows() -> None:
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="forms", transport=mem, wrap_collectives=False, heartbeat_s=60)
    tracer.set_topology({"dp": [(0,)]})
    timed = colls.wrap_function("all_reduce", _all_reduce)
    colls.route_to(tracer.recorder)
    try:
        with tracer.step(0):
            timed(torch.ones(8))
            timed(tensor=torch.ones(8), op=None, group=None, async_op=False)
            timed(torch.ones(4, dtype=torch.float16), group=None)
            timed(tensor=torch.ones(4, dtype=torch.float16))
        tracer.set_topology({"tp": [(0,)]})  # renamed: the keyword cache is forgotten with the rest
        with tracer.step(1):
            timed(tensor=torch.ones(2, dtype=torch.int64), async_op=False)
            timed(torch.ones(2, dtype=torch.int64))
    finally:
        colls.route_to(None)
        tracer.close()
    rows = mem.rows(Kind.COLLECTIVE)
    got = [(int(s), int(b), d, r) for s, b, d, r in zip(rows["step"], rows["bytes"], rows["dtype"], rows["role"])]
    assert got == [(0, 32, "float32", "dp"), (0, 32, "float32", "dp"), (0, 8, "float16", "dp"), (0, 8, "float16", "dp"),
                   (1, 16, "int64", "tp"), (1, 16, "int64", "tp")]
    assert list(rows["is_async"]) == [0] * 6 and list(rows["op"]) == ["all_reduce"] * 6
    assert all(rows["duration_ns"] >= 0) and tracer.errors == 0


def test_flat_instruction_rows_drain_row_by_row() -> None:
    from trainer_hooks.integrations import pipeline

    class Engine:
        pass

    def forward(self, buffer_id):
        return None

    def step(self):
        return None

    Engine._INSTRUCTION_MAP = {type("ForwardPass", (), {}): forward, type("OptimizerStep", (), {}): step}
    engine = Engine()
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="flat", transport=mem, wrap_collectives=False, heartbeat_s=60)
    assert pipeline.wrap(engine, tracer)
    fwd, opt = engine._INSTRUCTION_MAP.values()
    for n in range(3):
        with tracer.step(n):
            for b in range(n + 1):
                fwd(engine, buffer_id=b)
            opt(engine)
    tracer.close()
    rows = mem.rows(Kind.PIPE_INSTR)
    assert list(rows["step"]) == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert list(rows["instr"]) == ["ForwardPass", "OptimizerStep"] + ["ForwardPass"] * 2 + ["OptimizerStep"] + \
        ["ForwardPass"] * 3 + ["OptimizerStep"]
    assert list(rows["micro_batch"]) == [0, -1, 0, 1, -1, 0, 1, 2, -1]
    starts = list(rows["start_ns"])
    assert starts == sorted(starts) and all(rows["duration_ns"] >= 0)


def test_the_row_count_is_every_row_recorded_across_drains() -> None:
    """``Tracer.events`` (the benchmarks' denominator) is read off the buffers and the emitter's
    takes, not counted per event: it must equal the rows that reach the sink, a drain or not."""
    from trainer_hooks.integrations import pipeline

    class Engine:
        pass

    def forward(self, buffer_id):
        return None

    Engine._INSTRUCTION_MAP = {type("ForwardPass", (), {}): forward}
    engine = Engine()
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="count", transport=mem, wrap_collectives=False, heartbeat_s=60,
                    drain_interval_s=3600)
    assert pipeline.wrap(engine, tracer)
    (fwd,) = engine._INSTRUCTION_MAP.values()
    timed = colls.wrap_function("all_reduce", _all_reduce)
    colls.route_to(tracer.recorder)
    seen = []
    try:
        for n in range(4):
            with tracer.step(n):
                for b in range(n + 1):  # 1 + 2 + 3 + 4 instructions
                    fwd(engine, buffer_id=b)
                timed(torch.ones(8))  # 4 collectives
            tracer.record_offload("d2h", "grads", 64, 0, 10)  # 4 rows straight to the sink
            if n == 1:
                before = tracer.events
                tracer.emitter.drain()  # type: ignore[union-attr]
                seen.append((before, tracer.events))
        seen.append((tracer.events, tracer.events))
    finally:
        colls.route_to(None)
        tracer.close()
    per_step = [1 + 1 + 3 + 1, 2 + 1 + 3 + 1]  # instructions, the collective, STEP/THROUGHPUT/MEMORY, the offload
    assert seen[0] == (sum(per_step), sum(per_step))  # a drain moves rows, it does not change the count
    total = sum(len(mem.rows(k)["step"]) for k in (Kind.PIPE_INSTR, Kind.COLLECTIVE, Kind.STEP, Kind.THROUGHPUT,
                                                     Kind.MEMORY, Kind.OFFLOAD))
    assert total == 10 + 4 + 12 + 4 == seen[1][0], (total, seen)


def _rows_of(monkeypatch: pytest.MonkeyPatch, fast: bool) -> dict:
    """One run of instructions and collectives (positional, keyword, a group, async, no tensor)
    through the fast forms (``fast``) or the general ones, on a clock that ticks 1,000 ns a read:
    the same reads in the same order give the same numbers."""
    import itertools
    import time as time_mod

    from trainer_hooks import recorder as recorder_mod
    from trainer_hooks.integrations import pipeline

    ticks = itertools.count(10**15, 1000)

    def clock() -> int:
        return next(ticks)

    monkeypatch.setattr(time_mod, "perf_counter_ns", clock)  # the wrappers bind the clock when made
    monkeypatch.setattr(recorder_mod, "perf_counter_ns", clock)
    monkeypatch.setattr(pipeline, "perf_counter_ns", clock)
    calls: list[tuple] = []

    class Engine:
        pass

    def forward(self, buffer_id):
        calls.append(("forward", buffer_id))

    def reduce(self):
        calls.append(("reduce",))
        timed(torch.ones(8))
        timed(tensor=torch.ones(8), op=None, group=None, async_op=False)

    def optimizer(self, lr_kwargs=None):
        calls.append(("optimizer", lr_kwargs))

    Engine._INSTRUCTION_MAP = {type("ForwardPass", (), {}): forward, type("ReduceGrads", (), {}): reduce,
                               type("OptimizerStep", (), {}): optimizer}
    engine = Engine()
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="forms", transport=mem, wrap_collectives=False, heartbeat_s=60,
                    clock_ns=clock)
    tracer.set_topology({"dp": [(0,)]})
    assert pipeline.wrap(engine, tracer, simple=fast)
    fwd, red, opt = engine._INSTRUCTION_MAP.values()
    timed = colls.wrap_function("all_reduce", _all_reduce, bound=fast)
    assert (timed.__code__.co_filename.startswith("<tracetop")) is fast
    colls.route_to(tracer.recorder)
    try:
        for n in range(3):
            with tracer.step(n):
                for b in range(n + 1):
                    fwd(engine, buffer_id=b)
                fwd(engine, 9)
                red(engine)
                timed(torch.ones(4, dtype=torch.float16), None, None, False)
                timed(torch.ones(2, dtype=torch.int64), group=None, async_op=True)
                timed(None)
                opt(engine)
                opt(engine, lr_kwargs={"lr": n})
                tracer.set_loss(2.5 + n)  # a number: NaN would not equal itself
    finally:
        colls.route_to(None)
        tracer.close()
    rows = {k: {c: list(v) for c, v in mem.rows(k).items()} for k in (Kind.COLLECTIVE, Kind.PIPE_INSTR, Kind.STEP)}
    return {"rows": rows, "calls": calls, "errors": tracer.errors}


def test_the_fast_forms_give_the_general_forms_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's ``(engine, buffer_id)`` handler and the collective with the function's own
    parameters (``bound_call``) against the general ``*args, **kwargs`` forms: every column of every
    row equal, the handlers called with the same arguments."""
    fast = _rows_of(monkeypatch, True)
    general = _rows_of(monkeypatch, False)
    assert fast == general
    coll = fast["rows"][Kind.COLLECTIVE]
    assert len(coll["step"]) == 15 and fast["errors"] == 0
    assert coll["bytes"][:5] == [32, 32, 8, 16, 0] and coll["is_async"][:5] == [0, 0, 0, 1, 0]
    assert len(fast["rows"][Kind.PIPE_INSTR]["step"]) == 3 * 4 + 6 and len(set(coll["start_ns"])) == 15


@pytest.mark.parametrize("fast", [True, False])
def test_a_call_inside_a_call_counts_once_on_each_thread(fast: bool) -> None:
    """"Inside a timed call" is per thread: the owner's flag (the thread that routed the wrappers)
    and the other threads' set. A nested call counts once on either; another thread's call made
    while the owner is inside one is timed all the same."""
    import threading

    main = threading.get_ident()
    seen: list[tuple[bool, bool]] = []  # (on the owner's thread, inside as the DDP hook reads it)

    def body(tensor, op=None, group=None, async_op=False):
        if tensor.numel() == 1:  # a nested call: passed straight through
            return None
        seen.append((threading.get_ident() == main, colls.call_flag.inside))
        timed(torch.ones(1))
        if threading.get_ident() == main:
            other = threading.Thread(target=lambda: timed(torch.ones(2)))
            other.start()
            other.join()
        return None

    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="inside", transport=mem, wrap_collectives=False, heartbeat_s=60)
    tracer.set_topology({"dp": [(0,)]})
    timed = colls.wrap_function("all_reduce", body, bound=fast)
    colls.route_to(tracer.recorder)
    assert colls.call_flag.owner == main  # pytest's thread routed first: the flag's path is the one tested
    try:
        with tracer.step(0):
            timed(torch.ones(8))
            timed(torch.ones(8))
        assert not colls.call_flag.inside and not colls.call_flag.tids
    finally:
        colls.route_to(None)
        tracer.close()
    rows = mem.rows(Kind.COLLECTIVE)
    assert list(rows["bytes"]) == [8, 32, 8, 32]  # each thread's outer call, the inner one finishing first
    assert seen == [(True, True), (False, True)] * 2 and tracer.errors == 0
