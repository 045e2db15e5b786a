"""Async collectives timed to completion (trainer_hooks/integrations/async_done.py) on a real 2-process gloo
world: a plain ``all_reduce(async_op=True)``, FSDP2's explicit prefetch (``unshard(async_op=True)``),
on the CPU clock and on the GPU path (the fake ``torch.cuda.Event`` of tests/trainer_hooks/fake_cuda.py).

Ground truth: rank 1 sleeps LATE_MS before it joins each collective from step 1, so rank 0's
collective cannot complete sooner than that after rank 0 issued it, while the call itself
returns at once; the bytes are the tensors' (FSDP2: the unit's parameter bytes).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # one 2-process world: ~8 s, ~25 s loaded

STEPS, LATE_MS = 4, 150.0


def _rows(mem, kind) -> list[dict]:
    rows = mem.rows(kind)
    keys = list(rows)
    return [{k: (rows[k][i].item() if hasattr(rows[k][i], "item") else rows[k][i]) for k in keys}
            for i in range(len(rows[keys[0]]))] if keys else []


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tests.trainer_hooks.fake_cuda import FakeCudaClock, threads_that
    from tracetop.events import Kind
    from tracetop.wire.shipper import MemoryTransport
    from trainer_hooks import Tracer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result: dict = {}

    def late(step: int) -> None:
        if rank == 1 and step >= 1:
            time.sleep(LATE_MS / 1e3)

    for clock in ("cpu", "device"):
        mem = MemoryTransport()
        tracer = Tracer(rank=rank, world_size=2, run_id=clock, transport=mem, heartbeat_s=60, drain_interval_s=0.1,
                        device_clock=FakeCudaClock() if clock == "device" else None)
        t = torch.ones(1000)
        for step in range(STEPS):
            with tracer.step(step):
                with tracer.phase("forward"):
                    late(step)
                    work = dist.all_reduce(t, async_op=True)
                    work.wait()
                    late(step)
                    dist.isend(t, 1 - rank).wait() if rank == 0 else dist.irecv(t, 0).wait()
        time.sleep(0.3)
        tracer.close()
        result[clock] = {"rows": _rows(mem, Kind.COLLECTIVE), "steps": _rows(mem, Kind.STEP), "errors": tracer.errors}

    # FSDP2's explicit prefetch: the last unit all-gathered with async_op=True before the forward
    mem = MemoryTransport()
    tracer = Tracer(rank=rank, world_size=2, run_id="fsdp2", transport=mem, heartbeat_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    for m in model:
        fully_shard(m)
    fully_shard(model)
    x = torch.randn(8, 64)
    for step in range(STEPS):
        with tracer.step(step):
            with tracer.phase("forward"):
                late(step)
                handle = model[1].unshard(async_op=True)
                loss = model(x).square().mean()
                if handle is not None:
                    handle.wait()
            with tracer.phase("backward"):
                loss.backward()
    tracer.close()
    result["fsdp2"] = {"rows": _rows(mem, Kind.COLLECTIVE), "errors": tracer.errors}
    result["asked"] = sorted(threads_that("query") | threads_that("elapsed_time"))
    dist.barrier()
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("async_done")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, str(out)), nprocs=2, start_method="spawn", join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("clock", ["cpu", "device"])
def test_an_async_all_reduce_is_timed_to_its_completion(ranks, clock) -> None:
    got = ranks[0][clock]
    assert got["errors"] == 0
    rows = [r for r in got["rows"] if r["op"] == "all_reduce"]
    assert sorted(r["step"] for r in rows) == list(range(STEPS))
    assert {(r["bytes"], r["is_async"]) for r in rows} == {(4000, 1)}
    late_ns = LATE_MS * 1e6
    for r in rows:
        if r["step"] >= 1:  # rank 1 joined LATE_MS after rank 0 issued it: the row spans the wait
            assert r["duration_ns"] >= 0.8 * late_ns, r
    # the step's exposed communication is the issuing only (the wait in work.wait() is the phase's)
    steps = {s["step"]: s for s in got["steps"]}
    for s in range(1, STEPS):
        assert steps[s]["comm_exposed_ns"] < 0.5 * late_ns, steps[s]
    # gloo's p2p works have no future: their rows stay (time until return), asked once
    p2p = [r for r in got["rows"] if r["op"] == "isend"]
    assert sorted(r["step"] for r in p2p) == list(range(STEPS))


def test_the_device_path_is_resolved_by_the_emitter_only(ranks) -> None:
    for got in ranks:
        assert got["asked"] == ["tracetop-emitter"]


def test_fsdp2_explicit_prefetch_is_timed_to_completion_with_the_unit_bytes(ranks) -> None:
    got = ranks[0]["fsdp2"]
    assert got["errors"] == 0
    unit1 = 4 * (128 * 64 + 64)  # the prefetched unit's parameters, gathered whole
    prefetch = [r for r in got["rows"] if r["op"] == "all_gather_single" and r["is_async"] == 1]
    assert sorted(r["step"] for r in prefetch) == list(range(STEPS)), got["rows"]
    assert {r["bytes"] for r in prefetch} == {unit1}
    # step 0's prefetch comes before the model's first forward, where the FSDP module is found and
    # its group named dp (trainer_hooks.integrations.ddp.watch(model) names it sooner)
    assert {r["role"] for r in prefetch if r["step"] >= 1} == {"dp"}
    for r in prefetch:
        if r["step"] >= 1:
            assert r["duration_ns"] >= 0.8 * LATE_MS * 1e6, r
