"""Pure pieces and the single-process Tracer, on the in-memory transport."""

from __future__ import annotations

import time

import pytest

from tracetop.events import Kind
from tracetop.wire.shipper import MemoryTransport
from trainer_hooks import Tracer, bubble_rate, expected_bubble_rate
from trainer_hooks.identity import SetupError, resolve, sanitize_run_id
from trainer_hooks.integrations.collectives import busbw_factor, classify_ranks, peer_role


def test_identity_from_torchrun_slurm_and_arguments() -> None:
    tr = resolve(environ={"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "job 42/x"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.launcher) == (3, 8, 1, "torchrun")
    assert tr.run_id == "job-42-x"
    sl = resolve(environ={"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "991"})
    assert (sl.rank, sl.world_size, sl.local_rank, sl.run_id, sl.launcher) == (5, 16, 1, "991", "slurm")
    ex = resolve(rank=1, world_size=2, run_id="r1", environ={"TRACETOP_RUN_ID": "ignored"})
    assert (ex.rank, ex.world_size, ex.run_id) == (1, 2, "r1")
    assert resolve(environ={"TRACETOP_RUN_ID": "mine", "SLURM_JOB_ID": "7"}).run_id == "mine"
    assert resolve(environ={}, clock_s=lambda: 0).run_id == "run-19700101-000000"


def test_identity_setup_errors_say_what_to_do() -> None:
    with pytest.raises(SetupError, match="outside a world of 2"):
        resolve(rank=2, world_size=2, environ={})
    with pytest.raises(SetupError, match="TRACETOP_RUN_ID"):
        resolve(run_id="bad id!", environ={})
    with pytest.raises(SetupError, match="not an integer"):
        resolve(environ={"RANK": "x", "WORLD_SIZE": "2"})
    assert sanitize_run_id("  a b//c ") == "a-b-c"


def test_bubble_rate_matches_the_1f1b_formula() -> None:
    # balanced 1F1B: each stage computes m (f+b) inside (m+p-1)(f+b) of wall time
    for p, m in [(2, 2), (2, 8), (4, 4), (8, 32)]:
        f, b = 3.0, 6.0
        wall = (m + p - 1) * (f + b)
        assert bubble_rate(m * f, m * b, wall) == pytest.approx(expected_bubble_rate(p, m))
    assert expected_bubble_rate(2, 2) == pytest.approx(1 / 3)
    assert expected_bubble_rate(1, 4) == 0.0
    assert bubble_rate(1, 1, 0) != bubble_rate(1, 1, 0)  # NaN
    with pytest.raises(ValueError):
        expected_bubble_rate(0, 4)


def test_busbw_factors_follow_nccl_tests() -> None:
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("all_gather_into_tensor", 4) == pytest.approx(3 / 4)
    assert busbw_factor("reduce_scatter_tensor", 2) == pytest.approx(1 / 2)
    assert busbw_factor("broadcast", 8) == 1.0
    assert busbw_factor("send", 2) == 1.0


def test_roles_from_rank_sets() -> None:
    axes = {"tp": [(0, 1), (2, 3)], "pp": [(0, 2), (1, 3)], "dp": [(0,), (1,), (2,), (3,)], "mp": [(0, 1, 2, 3)]}
    assert classify_ranks((1, 0), axes, 4) == "tp"
    assert classify_ranks((0, 2), axes, 4) == "pp"
    assert classify_ranks((0, 1, 2, 3), axes, 4) == "mp"
    assert classify_ranks((0, 1, 2, 3), {}, 4) == "world"
    assert classify_ranks((0, 3), axes, 4) == "group"
    coords = {0: {"pipe": 0, "model": 0}, 1: {"pipe": 0, "model": 1}, 2: {"pipe": 1, "model": 0}, 3: {"pipe": 1, "model": 1}}
    roles = {"pipe": "pp", "model": "tp"}
    assert peer_role(coords.__getitem__, 0, 2, roles) == "p2p:pp"
    assert peer_role(coords.__getitem__, 0, 3, roles) == "p2p"


def _tracer(**kw) -> tuple[Tracer, MemoryTransport]:
    t = MemoryTransport()
    return Tracer(rank=0, world_size=1, run_id="unit", transport=t, wrap_collectives=False, **kw), t


def test_step_and_phases_make_one_step_row_with_self_times() -> None:
    tracer, mem = _tracer(tokens_per_step=640, samples_per_step=10, flops_per_token=1e6, peak_flops=1e12)
    for n in range(3):
        with tracer.step(n):
            with tracer.phase("data"):
                time.sleep(0.002)
            with tracer.phase("forward"):
                time.sleep(0.02)
            with tracer.phase("backward"):
                time.sleep(0.01)
            with tracer.phase("optimizer"):
                pass
    tracer.close()
    steps = mem.rows(Kind.STEP)
    assert list(steps["step"]) == [0, 1, 2]
    assert all(steps["forward_ns"] >= 20_000_000) and all(steps["backward_ns"] >= 10_000_000)
    assert all(steps["forward_ns"] > steps["backward_ns"])
    assert all(steps["compute_ns"] == steps["forward_ns"] + steps["backward_ns"] + steps["optimizer_ns"])
    assert all(steps["duration_ns"] >= steps["compute_ns"] + steps["data_wait_ns"])
    assert all(steps["comm_exposed_ns"] == 0) and list(steps["tokens"]) == [640] * 3
    tp = mem.rows(Kind.THROUGHPUT)
    assert tp["tokens_per_s"][0] == pytest.approx(640 / (steps["duration_ns"][0] / 1e9))
    assert tp["mfu"][0] == pytest.approx(tp["tflops"][0] * 1e12 / 1e12)
    mem_rows = mem.rows(Kind.MEMORY)
    assert list(mem_rows["step"]) == [0, 1, 2] and all(mem_rows["rss_bytes"] > 0)
    assert len(mem.rows(Kind.RUN_START)["rank"]) == 1
    assert len(mem.rows(Kind.HEARTBEAT)["rank"]) >= 1  # the closing heartbeat


def test_heartbeat_carries_step_and_phase() -> None:
    tracer, mem = _tracer(heartbeat_s=0.05)
    with tracer.step(7):
        with tracer.phase("forward"):
            time.sleep(0.3)
    tracer.close()
    hb = mem.rows(Kind.HEARTBEAT)
    inside = [i for i, p in enumerate(hb["phase"]) if p == "forward"]
    assert inside and all(hb["step"][i] == 7 for i in inside)


def test_each_heartbeat_ships_what_was_recorded_before_it() -> None:
    """Shipments every 60 s, heartbeats every 0.2 s: a finished step arrives with the next
    heartbeat, not a minute later (liveness and the rows before it travel together)."""
    mem = MemoryTransport()
    tracer = Tracer(rank=0, world_size=1, run_id="u", transport=mem, wrap_collectives=False, heartbeat_s=0.2,
                    flush_interval_s=60.0, drain_interval_s=60.0)
    try:
        with tracer.step(3):
            pass
        deadline = time.monotonic() + 30
        while not len(mem.rows(Kind.STEP)["step"]):
            assert time.monotonic() < deadline, "the step row waited for the 60 s shipment"
            time.sleep(0.02)
        assert list(mem.rows(Kind.STEP)["step"]) == [3] and len(mem.rows(Kind.HEARTBEAT)["step"]) >= 1
    finally:
        tracer.close()


class _BrokenShipper:
    endpoint = "broken"

    def record(self, *a):
        raise RuntimeError("boom")

    def record_many(self, *a):
        raise RuntimeError("boom")

    def close(self, timeout_s=0):
        pass

    def stats(self):
        return {}


def test_no_exception_escapes_a_hook() -> None:
    tracer = Tracer(rank=0, world_size=1, run_id="unit", shipper=_BrokenShipper(), wrap_collectives=False)
    ran = []
    for n in range(3):
        with tracer.step(n):
            with tracer.phase("forward"):
                ran.append(n)
    tracer.close()
    assert ran == [0, 1, 2] and tracer.errors >= 2  # RUN_START and the emitter's drain


def test_user_exceptions_pass_through_phases() -> None:
    tracer, _ = _tracer()
    with pytest.raises(KeyError):
        with tracer.step(0):
            with tracer.phase("forward"):
                raise KeyError("mine")
    tracer.close()
    assert tracer.errors == 0


def test_disabled_tracer_is_a_noop(monkeypatch) -> None:
    monkeypatch.setenv("TRACETOP_DISABLE", "1")
    tracer = Tracer()
    assert not tracer.enabled
    with tracer.step(0):
        with tracer.phase("forward"):
            pass
    tracer.close()
    assert tracer.shipper.stats() == {}


def test_callback_style_steps_and_phase_switches() -> None:
    """The protocol the HF and Lightning callbacks drive (begin_step / switch_phase / end_step)."""
    tracer, mem = _tracer()
    for n in range(2):
        tracer.begin_step(n)
        tracer.switch_phase("forward")
        time.sleep(0.01)
        tracer.switch_phase("backward")
        time.sleep(0.02)
        tracer.switch_phase(None)
        tracer.switch_phase("optimizer")
        tracer.end_step()  # closes the open optimizer phase too
    tracer.end_step()  # no step open: nothing happens
    tracer.close()
    steps = mem.rows(Kind.STEP)
    assert list(steps["step"]) == [0, 1]
    assert all(steps["forward_ns"] >= 10_000_000) and all(steps["backward_ns"] >= 20_000_000)
    assert all(steps["optimizer_ns"] >= 0) and tracer.errors == 0


def test_setup_errors_fail_fast_with_a_hint(monkeypatch) -> None:
    from trainer_hooks import SetupError

    monkeypatch.setenv("TRACETOP_HEARTBEAT_S", "often")
    with pytest.raises(SetupError, match="TRACETOP_HEARTBEAT_S"):
        Tracer(rank=0, world_size=1, run_id="u", transport=MemoryTransport(), wrap_collectives=False)
    monkeypatch.delenv("TRACETOP_HEARTBEAT_S")
    for bad in ("soon", "0"):
        monkeypatch.setenv("TRACETOP_FLUSH_S", bad)
        with pytest.raises(SetupError, match="TRACETOP_FLUSH_S"):
            Tracer(rank=0, world_size=1, run_id="u", transport=MemoryTransport(), wrap_collectives=False)
    monkeypatch.delenv("TRACETOP_FLUSH_S")
    monkeypatch.setenv("TRACETOP_BUFFER_BYTES", "lots")
    with pytest.raises(SetupError, match="TRACETOP_BUFFER_BYTES"):
        Tracer(rank=0, world_size=1, run_id="u", endpoint="127.0.0.1:9", wrap_collectives=False)
    with pytest.raises(SetupError, match="outside a world"):
        Tracer(rank=3, world_size=2, run_id="u", transport=MemoryTransport(), wrap_collectives=False)


def test_heartbeat_names_the_pending_collective() -> None:
    from trainer_hooks.integrations import collectives as colls

    tracer, mem = _tracer(heartbeat_s=0.05)
    tracer.set_topology({"tp": [(0,)]})

    class T:
        nbytes = 64
        dtype = "float32"

    def all_reduce(tensor, op=None, group=None, async_op=False):
        time.sleep(0.4)  # stuck in a collective, as a hung rank would be

    wrapped = colls.wrap_function("all_reduce", all_reduce)
    colls.route_to(tracer.recorder)
    try:
        with tracer.step(3):
            before = time.time_ns()
            wrapped(T())
    finally:
        colls.route_to(None)
    tracer.close()
    hb = mem.rows(Kind.HEARTBEAT)
    inside = [i for i, op in enumerate(hb["pending_op"]) if op == "all_reduce"]
    assert inside, list(hb["pending_op"])
    i = inside[0]
    assert (hb["phase"][i], hb["pending_role"][i], hb["step"][i]) == ("comm", "tp", 3)
    assert before - 5_000_000 <= hb["pending_since_ns"][i] <= hb["start_ns"][i]
    assert hb["pending_op"][-1] == "" and hb["pending_since_ns"][-1] == -1  # the closing heartbeat


def test_pipeline_handlers_get_exactly_what_the_engine_passes() -> None:
    """DeepSpeed calls ``handler(engine, buffer_id=i)``, ``handler(engine)`` or with other keywords;
    the timed handler passes each on unchanged and writes one PIPE_INSTR row per call."""
    from trainer_hooks.integrations import pipeline

    calls: list[tuple] = []

    class Engine:
        pass

    def forward(self, buffer_id):
        calls.append(("forward", buffer_id))
        return buffer_id

    def step(self, lr_kwargs=None):
        calls.append(("step", lr_kwargs))

    def reduce(self, *args, **kwargs):
        calls.append(("reduce", args, kwargs))

    def recv(self, other=None, buffer_id=None):  # buffer_id not first: it must stay a keyword
        calls.append(("recv", other, buffer_id))

    Engine._INSTRUCTION_MAP = {type("ForwardPass", (), {}): forward, type("OptimizerStep", (), {}): step,
                               type("ReduceGrads", (), {}): reduce, type("RecvGrad", (), {}): recv}
    engine = Engine()
    tracer, mem = _tracer()
    assert pipeline.wrap(engine, tracer)
    timed = {fn.__wrapped__.__name__: fn for fn in engine._INSTRUCTION_MAP.values()}
    with tracer.step(0):
        assert timed["forward"](engine, buffer_id=3) == 3
        assert timed["forward"](engine, 5) == 5
        timed["step"](engine)
        timed["step"](engine, lr_kwargs={"lr": 0.1})
        timed["reduce"](engine, 1, 2, x=3)
        timed["reduce"](engine, buffer_id=7)
        timed["recv"](engine, buffer_id=4)
        with pytest.raises(TypeError):  # a call the handler refuses fails as it would unwrapped (a handler of
            timed["forward"](engine, buffer_id=1, other=2)  # (engine, buffer_id): refused before a row is written
        with pytest.raises(TypeError):  # a general handler's refusal: after the wrapper took it (a row)
            timed["step"](engine, other=2)
    tracer.close()
    assert calls == [("forward", 3), ("forward", 5), ("step", None), ("step", {"lr": 0.1}),
                     ("reduce", (1, 2), {"x": 3}), ("reduce", (), {"buffer_id": 7}), ("recv", None, 4)]
    rows = mem.rows(Kind.PIPE_INSTR)
    assert list(rows["instr"]) == ["ForwardPass", "ForwardPass", "OptimizerStep", "OptimizerStep", "ReduceGrads",
                                   "ReduceGrads", "RecvGrad", "OptimizerStep"]
    assert list(rows["micro_batch"]) == [0, 1, -1, -1, -1, -1, 0, -1]
    assert tracer.errors == 0
