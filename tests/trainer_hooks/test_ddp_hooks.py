"""trainer_hooks.integrations.ddp on a real 2-process gloo world, rows in the in-memory transport: what DDP's
gradients become, hooks registered before / after / on top of ours, and what close() leaves."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _reference_grads(rank: int, world: int, x: torch.Tensor) -> list[torch.Tensor]:
    """The mean over ranks of the local gradients: what DDP must produce (its formula)."""
    import torch.distributed as dist

    m = _model()
    m(x).square().mean().backward()
    grads = [p.grad.detach().clone() for p in m.parameters()]
    for g in grads:
        dist.all_reduce(g)  # not traced (no Tracer installed here)
        g /= world
    return grads


def _train(ddp: torch.nn.Module, tracer, x: torch.Tensor, steps: int = STEPS, first: int = 0) -> list[torch.Tensor]:
    for step in range(first, first + steps):
        with tracer.step(step):
            with tracer.phase("forward"):
                loss = ddp(x).square().mean()
            with tracer.phase("backward"):
                loss.backward()
            if step < first + steps - 1:
                ddp.zero_grad()
    return [p.grad.detach().clone() for p in ddp.parameters()]


def _rows(mem, kind) -> list[dict]:
    rows = mem.rows(kind)
    keys = list(rows)
    return [{k: (rows[k][i].item() if hasattr(rows[k][i], "item") else rows[k][i]) for k in keys}
            for i in range(len(rows[keys[0]]))] if keys else []


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.modules import module as torch_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tracetop.events import Kind
    from tracetop.wire.shipper import MemoryTransport
    from trainer_hooks import Tracer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("trainer_hooks").addHandler(Catch())
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    ref = _reference_grads(rank, 2, x)
    original_register = DDP.register_comm_hook
    result: dict = {}

    def close_to(grads, rtol=1e-5, atol=1e-7) -> bool:
        return all(torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in zip(grads, ref))

    # 1. found at its first forward (made before the Tracer): default all-reduce, timed
    ddp = DDP(_model())
    mem = MemoryTransport()
    tracer = Tracer(rank=rank, world_size=2, run_id="a", transport=mem, heartbeat_s=60)
    grads = _train(ddp, tracer, x)
    hooks_in_step = []
    with tracer.step(STEPS):
        hooks_in_step.append(len(torch_module._global_forward_pre_hooks))
    after_ddp_hook = ddp._comm_hooks[0][0]
    tracer.close()
    result["default"] = {"grads_equal": close_to(grads), "rows": _rows(mem, Kind.COLLECTIVE),
                         "steps": _rows(mem, Kind.STEP), "errors": tracer.errors,
                         "watching_after": hooks_in_step[0],
                         "restored": DDP.register_comm_hook is original_register,
                         "global_hooks_left": len(torch_module._global_forward_pre_hooks)}
    # after close the hook it left passes straight through: backward still right, no rows
    ddp.zero_grad()
    ddp(x).square().mean().backward()
    result["default"]["after_close_equal"] = close_to([p.grad for p in ddp.parameters()])
    result["default"]["hook_name"] = after_ddp_hook.__name__

    # 2. the user's hook, registered after the Tracer exists (fp16 compression): timed, still compressing
    mem = MemoryTransport()
    tracer = Tracer(rank=rank, world_size=2, run_id="b", transport=mem, heartbeat_s=60)
    ddp = DDP(_model())
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    grads = _train(ddp, tracer, x)
    tracer.close()
    result["user_after"] = {"grads_close": close_to(grads, rtol=1e-2, atol=1e-4),
                            "grads_exact": close_to(grads, rtol=0, atol=0),
                            "rows": _rows(mem, Kind.COLLECTIVE), "errors": tracer.errors}

    # 3. the user registers a hook after ours is in (after the first forward): DDP would refuse a
    #    second registration; the user's call works and their hook is called, timed
    mem = MemoryTransport()
    tracer = Tracer(rank=rank, world_size=2, run_id="c", transport=mem, heartbeat_s=60)
    ddp = DDP(_model())
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    grads0 = _train(ddp, tracer, x, steps=1)
    ddp.zero_grad()
    ddp.register_comm_hook(dist.group.WORLD, counting_hook)
    grads1 = _train(ddp, tracer, x, steps=2, first=1)
    tracer.close()
    result["user_on_top"] = {"grads_equal": close_to(grads0) and close_to(grads1), "calls": len(calls),
                             "rows": _rows(mem, Kind.COLLECTIVE), "errors": tracer.errors}

    # 4. a hook registered before the Tracer existed: cannot be wrapped, said once, training unharmed
    ddp = DDP(_model())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    mem = MemoryTransport()
    del warnings[:]
    tracer = Tracer(rank=rank, world_size=2, run_id="d", transport=mem, heartbeat_s=60)
    grads = _train(ddp, tracer, x)
    tracer.close()
    result["user_before"] = {"grads_equal": close_to(grads), "rows": _rows(mem, Kind.COLLECTIVE),
                             "warnings": list(warnings), "errors": tracer.errors}

    # 5. TRACETOP_DDP_BUCKETS=0: DDP keeps its built-in path, a user's hook is registered as is
    os.environ["TRACETOP_DDP_BUCKETS"] = "0"
    mem = MemoryTransport()
    tracer = Tracer(rank=rank, world_size=2, run_id="e", transport=mem, heartbeat_s=60)
    ddp, ddp2 = DDP(_model()), DDP(_model())
    ddp2.register_comm_hook(None, counting_hook)
    grads = _train(ddp, tracer, x, steps=2)
    tracer.close()
    del os.environ["TRACETOP_DDP_BUCKETS"]
    result["off"] = {"grads_equal": close_to(grads), "rows": _rows(mem, Kind.COLLECTIVE), "hooks": len(ddp._comm_hooks),
                     "user_hook_as_is": ddp2._comm_hooks[0][0] is counting_hook}
    dist.barrier()
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.destroy_process_group()


pytestmark = pytest.mark.slow  # one 2-process world for every test here: ~15 s, ~40 s on a loaded machine


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ddp_hooks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, str(out)), nprocs=2, start_method="spawn", join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _grad_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in _model().parameters())


def _bucket_bytes_by_step(rows: list[dict]) -> dict[int, int]:
    got: dict[int, int] = {}
    for r in rows:
        if r["op"] == "all_reduce_ddp":
            got[r["step"]] = got.get(r["step"], 0) + r["bytes"]
    return got


def test_default_hook_timed_found_at_first_forward_gradients_unchanged(ranks) -> None:
    for got in ranks:
        d = got["default"]
        assert d["grads_equal"], "DDP's gradients changed under the timed hook"
        assert d["errors"] == 0
        assert _bucket_bytes_by_step(d["rows"]) == {s: _grad_bytes() for s in range(STEPS)}
        buckets = [r for r in d["rows"] if r["op"] == "all_reduce_ddp"]
        assert {(r["role"], r["group_size"], r["dtype"], r["is_async"]) for r in buckets} == {("dp", 2, "float32", 1)}
        assert all(r["duration_ns"] > 0 for r in buckets)
        # the wrapper does not count the inner hook's dist.all_reduce a second time
        assert not [r for r in d["rows"] if r["op"] == "all_reduce"]
        # the exposed wait is communication: every step's comm time is at least 0 and the phases
        # plus comm stay within the step
        for s in d["steps"]:
            assert 0 <= s["comm_exposed_ns"] <= s["duration_ns"]
            assert s["forward_ns"] + s["backward_ns"] + s["comm_exposed_ns"] <= s["duration_ns"]
        assert d["hook_name"] == "_allreduce_mean"  # DDP reads the name: the inner hook's (ours here)


def test_watching_stops_after_the_first_step_and_close_restores(ranks) -> None:
    for got in ranks:
        d = got["default"]
        assert d["watching_after"] == 0, "the global forward pre-hook outlived the second step"
        assert d["restored"] and d["global_hooks_left"] == 0
        assert d["after_close_equal"], "the hook left in DDP after close() changed the gradients"


def test_user_hook_registered_after_the_tracer_is_timed(ranks) -> None:
    for got in ranks:
        u = got["user_after"]
        assert u["grads_close"] and not u["grads_exact"], "fp16 compression should still be in effect"
        assert _bucket_bytes_by_step(u["rows"]) == {s: _grad_bytes() for s in range(STEPS)}
        assert u["errors"] == 0


def test_user_hook_registered_on_top_of_ours_is_called_and_timed(ranks) -> None:
    for got in ranks:
        u = got["user_on_top"]
        assert u["grads_equal"] and u["errors"] == 0
        assert u["calls"] >= 2  # steps 1 and 2, at least one bucket each
        assert _bucket_bytes_by_step(u["rows"]) == {s: _grad_bytes() for s in range(3)}


def test_hook_registered_before_the_tracer_is_left_alone_and_said(ranks) -> None:
    for got in ranks:
        u = got["user_before"]
        assert u["grads_equal"] and u["errors"] == 0
        assert not [r for r in u["rows"] if r["op"] == "all_reduce_ddp"]
        assert any("registered before the Tracer existed" in w for w in u["warnings"]), u["warnings"]


def test_ddp_bucket_timing_can_be_turned_off(ranks) -> None:
    for got in ranks:
        off = got["off"]
        assert off["grads_equal"] and off["hooks"] == 0 and off["user_hook_as_is"]
        assert not [r for r in off["rows"] if r["op"] == "all_reduce_ddp"]
