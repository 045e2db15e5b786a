"""The training loop: process groups, the engine for the layout, the step loop, logs, checkpoints.

Launched once per rank by torchrun (``torchrun --nproc_per_node N -m reference_trainer ...``);
run without torchrun it is a world of one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from typing import Any

from reference_trainer import adjust as adjust_mod
from reference_trainer import tracing as tracing_mod
from reference_trainer.config import (
    PRESETS,
    Layout,
    LayoutError,
    ModelPreset,
    add_trainer_arguments,
    ds_config,
    flops_per_token,
    make_layout,
)
from reference_trainer.faults import (
    FaultSpecError,
    SlowMicroBatch,
    StageClock,
    parse_faults,
    parse_slow_micro_batch,
)
from reference_trainer.stop import StopFile, describe


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m reference_trainer",
        description="3D-parallel (tensor x pipeline x data) GPT-style trainer on DeepSpeed, with fault "
        "injection. Launch with torchrun --nproc_per_node N -m reference_trainer ...",
    )
    add_trainer_arguments(p)
    return p


@dataclasses.dataclass
class Run:
    """What the adjustments and the loop share about this rank's run."""

    engine: Any
    layout: Layout
    preset: ModelPreset
    micro_batch: int
    micro_batches: int
    rank: int
    stage: int
    dp_rank: int
    offload_states_on: bool = False
    states_offloaded: bool = False
    step: int = 0
    n_params: int = 0
    tracing: Any = None
    rebuild: Any = None  # (offload: str) -> None; set in the ZeRO shape
    refuse_commands: list = dataclasses.field(default_factory=list)  # --inject-refuse-command
    rebalance: Any = None  # the trainer_hooks.rebalance.Rebalance in force (None: balanced)
    loss_weight: Any = None  # the 3D shape's WeightedLoss (its weight: this pipe's rebalance weight)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.layout.dp


class WeightedLoss:
    """The pipeline's loss_fn x ``weight``: a rebalanced pipe's loss weighted by dp x its share /
    the global batch (adjust.set_rebalance); 1.0 when balanced."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.weight = 1.0

    def __call__(self, logits: Any, labels: Any) -> Any:
        loss = self.fn(logits, labels)
        return loss if self.weight == 1.0 else loss * self.weight


def _env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher, or a world of one."""
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def _fail(rank: int, message: str) -> int:
    if rank == 0:
        print(f"reference_trainer: {message}", file=sys.stderr, flush=True)
    return 2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world_size, local_rank = _env_world()
    preset = PRESETS[args.model]
    try:
        layout = make_layout(world_size, args.tp, args.pp, args.zero, args.offload, preset)
        faults = parse_faults(args, world_size=world_size, pp=args.pp)
        slow_micro_batch = parse_slow_micro_batch(args.inject_slow_micro_batch)
        adjustments = [adjust_mod.parse_adjustment(a) for a in args.adjust]
    except (LayoutError, FaultSpecError, adjust_mod.AdjustError) as e:
        return _fail(rank, str(e))
    if args.micro_batch < 1 or args.micro_batches < 1 or args.steps < 0:
        return _fail(rank, "--micro-batch and --micro-batches must be at least 1, --steps at least 0")
    for a in adjustments:
        if a.key == "rebalance":
            try:
                adjust_mod.check_rebalance(a.value, dp=layout.dp, micro_batch=args.micro_batch,
                                           micro_batches=args.micro_batches, pipelined=layout.shape == "3d")
            except adjust_mod.AdjustError as e:
                return _fail(rank, f"--adjust {a.step}:rebalance: {e}")
        elif a.key == "micro_batch":
            try:
                adjust_mod.plan_micro_batch(args.micro_batch, args.micro_batches, a.value)
            except adjust_mod.AdjustError as e:
                return _fail(rank, f"--adjust {a.step}:micro_batch={a.value}: {e}")
        elif a.key == "offload" and adjust_mod.offload_method(layout)[0] is None:
            return _fail(rank, f"--adjust {a.step}:offload: {adjust_mod.offload_method(layout)[1]}")
    if layout.offload == "nvme":
        why = _nvme_unavailable()
        if why:
            return _fail(rank, why)
    return _train(args, layout, preset, faults, adjustments, rank, local_rank, slow_micro_batch=slow_micro_batch)


def _nvme_unavailable() -> str | None:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if AsyncIOBuilder().is_compatible(verbose=False):
            return None
    except Exception as e:  # an absent builder is the same answer as an incompatible one
        return f"--offload nvme needs DeepSpeed's async_io op, which cannot load here ({e}); use --offload cpu"
    return ("--offload nvme needs DeepSpeed's async_io op, which is not available here (it needs libaio: install "
            "libaio-dev, then DeepSpeed builds the op on first use, or at install with DS_BUILD_AIO=1); "
            "or use --offload cpu")


def _init_distributed(timeout_s: float) -> None:
    from datetime import timedelta

    import deepspeed
    import torch.distributed.distributed_c10d as c10d

    # The shm comm kernel serves only inference_all_reduce; skip its JIT build (~60-100 s on CPU).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    timeout = timedelta(seconds=timeout_s)
    # DeepSpeed creates its groups (dp, pp, tp, ...) with torch's default timeout, not the one given
    # to init: set the default so --dist-timeout-s bounds every collective of the run.
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(timeout=timeout)


def _build_engine(args: argparse.Namespace, layout: Layout, preset: ModelPreset, rank: int, bf16: bool, *,
                  micro_batch: int, micro_batches: int, grid: Any = None, loss: Any = None):
    """The DeepSpeed engine for ``layout``. The ZeRO shape reuses ``grid`` (its process groups)
    when given one, as a rebuild at a new ZeRO config does."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    from reference_trainer.model import GPT, Embedding, layer_specs, loss_fn
    from reference_trainer.tp_layers import TPGroup

    topo = PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)
    coord = topo.get_coord(rank)
    tp = TPGroup(coord.model, layout.tp)
    cfg = ds_config(layout, micro_batch=micro_batch, micro_batches=micro_batches, lr=args.lr,
                    bf16=bf16, nvme_path=args.nvme_path)
    if layout.shape == "3d":
        module = PipelineModule(layers=layer_specs(preset, tp, args.seed), loss_fn=loss or loss_fn, topology=topo,
                                partition_method="type:TransformerBlock")
        grid = module.mpu()
        tp.group = grid.get_slice_parallel_group()
        params = [p for p in module.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=cfg)
    else:
        grid = grid or PipelineParallelGrid(topology=topo)
        tp.group = grid.get_slice_parallel_group()
        model = GPT(preset, tp, args.seed)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                               config=cfg, mpu=grid)
    embedding = next((m for m in engine.module.modules() if isinstance(m, Embedding)), None)
    return engine, topo, coord, cfg, embedding, grid


def _meta(run: Run, cfg: dict, topo: Any) -> dict:
    lay = run.layout
    return dict(world_size=lay.world_size, tp=lay.tp, pp=lay.pp, dp=lay.dp, zero_stage=lay.zero,
                model_name=run.preset.name, n_params=run.n_params, flops_per_token=flops_per_token(run.preset),
                micro_batch=run.micro_batch, micro_batches=run.micro_batches, seq_len=run.preset.seq_len,
                ds_config=cfg, topology=topo, stage=run.stage)


def _train(args, layout, preset, faults, adjustments, rank, local_rank, *,
           slow_micro_batch: dict[int, SlowMicroBatch]) -> int:
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from reference_trainer.data import micro_batches_for
    from reference_trainer.model import loss_fn

    accel = get_accelerator()
    on_gpu = accel.device_name() == "cuda"
    if on_gpu:  # before the process groups: NCCL binds each rank to its device
        accel.set_device(local_rank)
    _init_distributed(args.dist_timeout_s)
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and on_gpu)
    torch.manual_seed(args.seed)

    weighted = WeightedLoss(loss_fn)
    engine, topo, coord, cfg, embedding, grid = _build_engine(
        args, layout, preset, rank, bf16, micro_batch=args.micro_batch, micro_batches=args.micro_batches, loss=weighted)
    run = Run(engine=engine, layout=layout, preset=preset, micro_batch=args.micro_batch,
              micro_batches=args.micro_batches, rank=rank, stage=coord.pipe, dp_rank=coord.data, loss_weight=weighted)
    clock = StageClock(faults, rank=rank, stage=coord.pipe, micro_batches=lambda: run.micro_batches,
                       micro_batch=lambda: run.micro_batch,
                       activation_bytes_per_sample=int(args.activation_mb_per_sample * 2**20),
                       slow_micro_batch=slow_micro_batch, sample_ms=args.sample_ms)
    run.refuse_commands = list(args.inject_refuse_command)
    clock.device = engine.device
    if clock.needs_hang_group:  # every rank takes part in creating it; only the hanging rank uses it
        clock.hang_group = dist.new_group(ranks=list(range(layout.world_size)), backend="gloo")
    clock.install(engine, engine.module, embedding if coord.pipe == 0 else None)
    stop = StopFile(args.stop_file, rank) if args.stop_file else None

    start_step = 0
    if args.load_dir:
        _, client = engine.load_checkpoint(args.load_dir, tag=args.load_tag)
        if client is None:
            return _fail(rank, f"--load-dir {args.load_dir}: no DeepSpeed checkpoint found there"
                         + (f" with tag {args.load_tag}" if args.load_tag else ""))
        start_step = int(client.get("step", 0))

    run.n_params = _count_params(engine, coord, layout)
    fpt = flops_per_token(preset)
    run.tracing = tracing_mod.start(engine, args, meta=_meta(run, cfg, topo))

    def rebuild(offload: str) -> None:
        """Checkpoint, then a new engine with the new ZeRO offload config, loaded from it: the
        in-process form of checkpoint-and-relaunch, for engines offload_states cannot serve."""
        import gc

        try:
            new_layout = make_layout(layout.world_size, layout.tp, layout.pp, run.layout.zero, offload, preset)
        except LayoutError as e:
            raise adjust_mod.AdjustError(str(e)) from e
        folder = args.save_dir or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"reference_trainer-{os.environ.get('MASTER_PORT', 'x')}-relaunch")
        tag = f"relaunch-step{run.step}"
        run.engine.save_checkpoint(folder, tag=tag, client_state={"step": run.step}, save_latest=False)
        run.tracing.close()
        run.engine = None
        gc.collect()
        accel.empty_cache()
        new_engine, _, _, new_cfg, new_embedding, _ = _build_engine(
            args, new_layout, preset, rank, bf16, micro_batch=run.micro_batch, micro_batches=run.micro_batches,
            grid=grid)
        new_engine.load_checkpoint(folder, tag=tag)
        clock.install(new_engine, new_engine.module, new_embedding if coord.pipe == 0 else None)
        run.engine, run.layout = new_engine, new_layout
        run.tracing = tracing_mod.start(new_engine, args, meta=_meta(run, new_cfg, topo))

    if layout.shape == "zero":
        run.rebuild = rebuild
    log = open(args.log_jsonl, "a") if (args.log_jsonl and rank == 0) else None
    rank_log = None
    if args.rank_log_dir:
        os.makedirs(args.rank_log_dir, exist_ok=True)
        rank_log = open(os.path.join(args.rank_log_dir, f"rank{rank}.jsonl"), "a")
    if rank == 0 and not args.quiet:
        print(f"[reference_trainer] model {preset.name} ({run.n_params / 1e6:.2f}M params, {fpt / 1e6:.1f} "
              f"MFLOP/token) layout tp={layout.tp} pp={layout.pp} dp={layout.dp} zero={layout.zero} "
              f"offload={layout.offload} shape={layout.shape} micro_batch={run.micro_batch} "
              f"micro_batches={run.micro_batches} global_batch={run.global_batch} "
              f"dtype={'bf16' if bf16 else 'fp32'}", flush=True)
    done, stopped = start_step, False  # stopped: by --stop-file, before --steps
    try:
        for step in range(start_step, args.steps):
            if stop is not None and stop.should_stop(step):
                stopped = True
                if rank == 0:
                    print(describe(stop, step), flush=True)
                break
            run.step = step
            for a in adjustments:
                if a.step == step:
                    _apply(run, a)
            _apply_commands(run, step)
            engine = run.engine
            clock.begin_step(step)
            r = run.rebalance
            batches = micro_batches_for(step, args.seed, dp_rank=run.dp_rank, dp=layout.dp,
                                        micro_batch=run.micro_batch, micro_batches=run.micro_batches,
                                        vocab=preset.vocab, seq_len=preset.seq_len,
                                        offset=None if r is None else r.offset(run.dp_rank),
                                        sizes=None if r is None else r.micro_batch_sizes(run.dp_rank, run.micro_batches))
            t0 = time.perf_counter()
            with run.tracing.step(step):
                if layout.shape == "3d":
                    loss = float(engine.train_batch(data_iter=iter(batches)))
                else:
                    loss = _zero_step(engine, batches, loss_fn, run)
                if hasattr(run.tracing, "set_loss"):  # optional, like adjustments()
                    run.tracing.set_loss(loss)
            step_time_s = time.perf_counter() - t0
            adjust_mod.offload_now(run)
            tokens_per_s = run.global_batch * preset.seq_len / step_time_s
            record = {"step": step, "time_unix_s": time.time(), "loss": loss, "step_time_s": step_time_s,
                      "tokens_per_s": tokens_per_s, "achieved_tflops": tokens_per_s * fpt / 1e12,
                      "micro_batch": run.micro_batch, "micro_batches": run.micro_batches,
                      "global_batch": run.global_batch, "samples": sum(len(x) for x, _ in batches)}
            if rank == 0:
                if not args.quiet:
                    print(f"step {step} loss {loss:.4f} step_time {step_time_s * 1000:.1f} ms "
                          f"tokens/s {tokens_per_s:.0f}", flush=True)
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
            if rank_log:
                rank_log.write(json.dumps({
                    **record, "rank": rank, "stage": coord.pipe, "dp_rank": coord.data, "tp_rank": coord.model,
                    "forward_s": clock.forward_s, "backward_s": clock.backward_s,
                    "dp_reduce_s": clock.dp_reduce_s, "rss_bytes": _rss_bytes(),
                    "optimizer_cpu_offload": _optimizer_on_host(engine),
                    "offloaded_states": sorted(str(getattr(s, "value", s))
                                               for s in getattr(engine.optimizer, "offloaded_states", ())),
                    "peak_rss_bytes": _peak_rss_bytes(),
                    **({"device_allocated_bytes": accel.memory_allocated(),
                        "device_peak_bytes": accel.max_memory_allocated()} if on_gpu else {})}) + "\n")
                rank_log.flush()
            done = step + 1
            if args.save_dir and ((args.save_every and done % args.save_every == 0) or done == args.steps):
                engine.save_checkpoint(args.save_dir, tag=f"step{done}", client_state={"step": done})
        if stopped and args.save_dir and done > start_step and not (args.save_every and done % args.save_every == 0):
            run.engine.save_checkpoint(args.save_dir, tag=f"step{done}", client_state={"step": done})
    finally:
        run.tracing.close()
        if log:
            log.close()
        if rank_log:
            rank_log.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _optimizer_on_host(engine: Any) -> bool:
    """What DeepSpeed's ZeRO optimizer itself says about optimizer offload (stage 1/2, stage 3)."""
    opt = engine.optimizer
    return bool(getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False))


def _apply_commands(run: Run, step: int) -> None:
    """The control path's seam: at every step boundary, outside any step, the loop asks the
    tracing object for adjustments all ranks agreed to apply at ``step``
    (``tracing.adjustments(step) -> [(key, value), ...]``, keys as in --adjust: ``micro_batch`` an
    int, ``offload`` a bool) and reports each outcome back
    (``tracing.adjustment_result(step, key, value, applied, message)``). Both are optional.

    All or none: ``adjustment_result`` returns False when another rank could not apply it; this
    rank then undoes it here, still before ``step``, and says how that went
    (``tracing.adjustment_undone(step, key, previous, ok, message)``)."""
    pending = getattr(run.tracing, "adjustments", None)
    if pending is None:
        return
    report = getattr(run.tracing, "adjustment_result", None)
    undone = getattr(run.tracing, "adjustment_undone", None)
    for key, value in pending(step) or ():
        previous = _in_force(run, key)
        try:
            _refuse_if_injected(run, key, value)
            _apply(run, adjust_mod.Adjustment(step, key, value))
            applied, message = True, ""
        except adjust_mod.AdjustError as e:
            applied, message = False, str(e)
        agreed = report(step, key, value, applied, message) if report is not None else True
        if agreed is False:
            # Every rank puts back (re-asserts) the value in force before: the ranks that applied
            # it undo it, the others set what they already have. Both matter on the PipelineEngine:
            # a set resets its cached activation shapes, and a stage that resets must have a
            # neighbour that resets too, or the next send/receive pair disagrees and hangs.
            try:
                _apply(run, adjust_mod.Adjustment(step, key, previous))
                ok, message = True, ""
            except adjust_mod.AdjustError as e:
                ok, message = False, str(e)
            if applied and undone is not None:
                undone(step, key, previous, ok, message)


def _in_force(run: Run, key: str) -> Any:
    """The value of an adjustment's key in force now (what an undo restores)."""
    if key == "micro_batch":
        return run.micro_batch
    if key == "rebalance":
        if run.rebalance is not None:
            return run.rebalance
        from trainer_hooks.rebalance import Rebalance

        return Rebalance((run.micro_batch * run.micro_batches,) * run.layout.dp)
    if adjust_mod.offload_method(run.layout)[0] == "relaunch":
        return run.layout.offload != "none"
    return run.offload_states_on


def _refuse_if_injected(run: Run, key: str, value: Any) -> None:
    """--inject-refuse-command RANK[:KEY=VALUE]: that rank refuses (the all-or-none tests' seam)."""
    shown = (("on" if value else "off") if key == "offload" else ",".join(map(str, value.samples))
             if key == "rebalance" else str(value))
    for spec in run.refuse_commands:
        rank, _, which = spec.partition(":")
        if rank.strip() == str(run.rank) and which in ("", f"{key}={shown}"):
            raise adjust_mod.AdjustError(f"injected: rank {run.rank} refuses {key}={shown} "
                                         f"(--inject-refuse-command {spec})")


def _apply(run: Run, a: adjust_mod.Adjustment) -> None:
    if a.key == "micro_batch":
        adjust_mod.set_micro_batch(run, int(a.value))
    elif a.key == "offload":
        adjust_mod.set_optimizer_offload(run, bool(a.value))
    elif a.key == "rebalance":
        adjust_mod.set_rebalance(run, a.value)
    else:
        raise adjust_mod.AdjustError(f"unknown adjustment {a.key!r}; use micro_batch, offload or rebalance")
    if run.rank == 0:
        print(f"[reference_trainer] step {a.step}: {a.key} -> {a.value} (micro_batch={run.micro_batch}, "
              f"micro_batches={run.micro_batches}, global_batch={run.global_batch})", flush=True)


def _zero_step(engine, batches, loss_fn, run: Run) -> float:
    """One step of the ZeRO shape: gradient accumulation over the micro-batches, then the
    optimizer; returns the loss averaged over the global batch (as the pipeline engine does)."""
    import torch
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    r = run.rebalance
    for i, (x, y) in enumerate(batches):
        engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
        logits = engine(x.to(engine.device))
        loss = loss_fn(logits, y.to(engine.device))
        if r is not None:  # this micro-batch's share of the global batch (adjust.set_rebalance)
            loss = loss * r.micro_weight(run.dp_rank, len(x), len(batches))
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    total /= len(batches)
    if run.layout.dp > 1:
        dist.all_reduce(total, group=engine.mpu.get_data_parallel_group())
        total /= run.layout.dp
    return float(total)


def _count_params(engine, coord, layout: Layout) -> int:
    """Parameters of the whole model (every stage, TP shards counted once)."""
    import torch
    import torch.distributed as dist

    local = 0
    for p in engine.module.parameters():
        n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        sharded = getattr(p, "model_parallel", False)
        if sharded or coord.model == 0:
            local += n
    t = torch.tensor([float(local)], device=engine.device)
    # Sum over every rank of one data-parallel replica (its stages and TP ranks).
    dist.all_reduce(t)
    return int(round(t.item() / layout.dp))
