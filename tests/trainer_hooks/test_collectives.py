"""Collective timing on a real gloo world of 2 processes, shipped to the in-memory transport."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from tracetop.events import Kind
    from tracetop.wire.shipper import MemoryTransport
    from trainer_hooks import Tracer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    original = dist.all_reduce
    mem = MemoryTransport()
    tracer = Tracer(rank=rank, world_size=2, run_id="coll", transport=mem, heartbeat_s=60)
    tracer.set_topology({"dp": [(0, 1)]}, lambda r: {"data": r}, {"data": "dp"})
    wrapped_identity = dist.isend is dist.distributed_c10d.isend and dist.isend is not original
    peer = 1 - rank
    with tracer.step(0):
        dist.all_reduce(torch.ones(1000))                                   # 4000 B
        gathered = torch.empty(600, dtype=torch.float16)
        dist.all_gather_into_tensor(gathered, torch.ones(300, dtype=torch.float16))  # output 1200 B
        dist.broadcast(tensor=torch.zeros(10, dtype=torch.int64), src=0)    # keyword call: 80 B
        if rank == 0:
            dist.send(torch.ones(123, dtype=torch.float64), dst=1)          # 984 B, counted once
        else:
            dist.recv(torch.empty(123, dtype=torch.float64), src=0)
        w = dist.isend(torch.ones(7), dst=peer) if rank == 0 else dist.irecv(torch.empty(7), src=peer)
        w.wait()
        ops = [dist.P2POp(dist.isend, torch.ones(5), peer), dist.P2POp(dist.irecv, torch.empty(5), peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        work = dist.all_reduce(torch.ones(16), async_op=True)
        work.wait()
        dist.barrier()
        with tracer.phase("forward"):
            dist.all_reduce(torch.ones(4))
    tracer.close()
    restored = dist.all_reduce is original and not hasattr(dist.distributed_c10d.isend, "_tracetop_wrapper")
    rows = mem.rows(Kind.COLLECTIVE)
    steps = mem.rows(Kind.STEP)
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps({
        "rows": [{k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in rows.items()} for i in range(len(rows["op"]))],
        "step": {k: int(v[0]) for k, v in steps.items() if k != "loss"},  # loss: NaN until given
        "restored": restored, "wrapped_identity": wrapped_identity,
    }))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("coll")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, str(out)), nprocs=2, start_method="spawn", join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _by_op(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows by op in issue order (an async call's row is written at its completion, after later calls')."""
    got: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["start_ns"]):
        got.setdefault(r["op"], []).append(r)
    return got


def test_bytes_equal_tensor_sizes_and_nesting_counts_once(ranks) -> None:
    for rank, got in enumerate(ranks):
        ops = _by_op(got["rows"])
        assert [r["bytes"] for r in ops["all_reduce"]] == [4000, 64, 16]
        assert [r["bytes"] for r in ops["all_gather_into_tensor"]] == [1200]
        assert "all_gather_single" not in ops  # the nested c10d call is not counted again
        assert [(r["bytes"], r["dtype"]) for r in ops["broadcast"]] == [(80, "int64")]
        p2p = "send" if rank == 0 else "recv"
        assert [(r["bytes"], r["dtype"], r["peer"], r["is_async"]) for r in ops[p2p]] == [(984, "float64", 1 - rank, 0)]
        assert "isend" not in ops or rank == 1 or len(ops["isend"]) == 1
        single = ops["isend" if rank == 0 else "irecv"]
        assert [(r["bytes"], r["is_async"], r["role"]) for r in single] == [(28, 1, "p2p:dp")]
        assert [(r["bytes"], r["is_async"]) for r in ops["batch_isend_irecv"]] == [(40, 1)]
        assert [r["is_async"] for r in ops["all_reduce"]] == [0, 1, 0]
        assert ops["barrier"][0]["bytes"] == 0
        assert {r["role"] for r in ops["all_reduce"]} == {"dp"} and {r["group_size"] for r in ops["all_reduce"]} == {2}


def test_collective_time_is_exposed_comm_not_compute(ranks) -> None:
    for got in ranks:
        # the async all_reduce (64 B) is timed to its completion; only the time it took to return
        # (no longer than that) is exposed. Every other call here is exposed whole (gloo's isend /
        # irecv works have no future: timed until they return)
        timed_to_completion = [r for r in got["rows"] if r["op"] == "all_reduce" and r["is_async"] == 1]
        assert len(timed_to_completion) == 1
        total = sum(r["duration_ns"] for r in got["rows"] if r not in timed_to_completion)
        assert total <= got["step"]["comm_exposed_ns"] <= total + timed_to_completion[0]["duration_ns"]
        # the all_reduce inside the forward phase is not forward compute
        inside = _by_op(got["rows"])["all_reduce"][-1]["duration_ns"]
        assert got["step"]["forward_ns"] >= 0 and got["step"]["forward_ns"] < got["step"]["duration_ns"] - inside + 1


def test_wrappers_share_identity_and_are_restored(ranks) -> None:
    assert all(g["wrapped_identity"] for g in ranks)
    assert all(g["restored"] for g in ranks)
