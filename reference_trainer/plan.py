"""The parallelism planner: pure functions from a model and a cluster to ranked TP x PP x DP plans.

Beside the reference trainer, whose flags its launch commands carry (`trainer_flags`), and used by
nothing else: `tracetop plan` (reference_trainer/plan_cli.py) is its thin edge. No I/O, no torch and
no other module of ours: it is arithmetic on the inputs.

Memory per GPU (bytes), mixed precision with Adam, the ZeRO paper's accounting
(Rajbhandari et al. 2020): per parameter held by a GPU, 2 bytes of bf16 weights, 2 of bf16
gradients and K = 12 of optimizer state (fp32 master weights, momentum, variance). A GPU holds
P / (tp * pp) parameters (the model split evenly; embeddings counted like any layer). ZeRO shards
across the dp ranks:

    stage 0:  2 + 2 + 12            stage 2:  2 + (2 + 12) / dp
    stage 1:  2 + 2 + 12 / dp       stage 3:  (2 + 2 + 12) / dp

Offload `cpu` moves the optimizer state (and its fp32 gradient copy) to host memory: the GPU
keeps weights and its gradient shard; with ZeRO-3 `cpu` moves the parameters too (the GPU keeps
only a working set, counted as one layer's weights).

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", tensor parallel without sequence parallel):

    s * b * h * (10 + 24 / t + 5 * a * s / (h * t))  bytes      (no recomputation)
    2 * s * b * h                                     bytes      (full recomputation: layer inputs only)

with s the sequence length, b the micro-batch, h the hidden size, a the attention heads, t = tp.
Under 1F1B the first stage keeps the activations of min(pp, m) micro-batches in flight, so the
heaviest stage holds (layers / pp) * min(pp, m) of them.

Time per step (an estimate for ranking, not a promise): compute = 6 * P * tokens / (gpus * achieved
FLOP/s), 8 * P * tokens with full recomputation; the pipeline stretches it by 1 / (1 - bubble),
bubble = (p - 1) / (m + p - 1); tensor parallel adds 4 all-reduces of s*b*h*2 bytes per layer and
micro-batch at the intra-node bus bandwidth; the pipeline sends one activation forward and one
gradient back (s*b*h*2 bytes each) per micro-batch and bubble slot, (m + p - 1) of them, counted
on the critical path at the bandwidth of the link between stages; grad-sync moves each GPU's bf16 gradients
(all-reduce, or reduce-scatter + all-gather: 2(n-1)/n of the bytes; ZeRO-3 3(n-1)/n) at the
bus bandwidth of the links the DP group spans, and is counted as fully exposed (an upper bound);
offload adds the PCIe copies (2 + 2 bytes per parameter of the rank's shard) at the host link's
GB/s and the host optimizer step over that shard (an assumed 2e9 parameters/s, DeepSpeed's CPU Adam).

Rules the reference trainer (and DeepSpeed's pipeline engine) impose, restated here (a test checks
every plan against reference_trainer.config.make_layout): ZeRO 2/3 only without a pipeline
(pp = 1); offload only with ZeRO >= 2 and pp = 1; TP inside one node and dividing the heads; PP
dividing the layers.
"""

from __future__ import annotations

import dataclasses
import math

from tracetop.errors import TracetopError

BYTES_WEIGHT = 2  # bf16
BYTES_GRAD = 2  # bf16
BYTES_OPTIM = 12  # fp32 master + Adam m + v
GB = 1e9


class PlanError(TracetopError, ValueError):
    """Inputs no plan can satisfy; the message says why and what would fit."""


@dataclasses.dataclass(frozen=True)
class Model:
    params: float
    layers: int
    hidden: int
    heads: int
    seq: int

    @property
    def derived_note(self) -> str:
        return f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}"


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    reserve_frac: float = 0.10  # kept free for the allocator, workspaces, NCCL buffers
    achieved_tflops: float = 150.0  # per GPU, bf16 matmuls as achieved (not peak)
    intra_busbw_gbps: float = 150.0  # NVLink bus bandwidth (NCCL-tests busbw) inside a node
    inter_busbw_gbps: float = 40.0  # bus bandwidth across nodes
    host_gbps: float = 20.0  # PCIe device<->host, per GPU
    cpu_adam_params_per_s: float = 2e9  # host optimizer step (DeepSpeed CPU Adam), per rank; an assumption

    @property
    def budget_gb(self) -> float:
        return self.gpu_mem_gb * (1 - self.reserve_frac)


@dataclasses.dataclass(frozen=True)
class Memory:
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.grads_gb + self.optimizer_gb + self.activations_gb


@dataclasses.dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    dp: int
    zero_stage: int
    offload: str  # none | cpu
    recompute: bool
    micro_batch: int
    micro_batches: int
    memory: Memory
    bubble: float
    grad_sync_ms: float
    tp_comm_ms: float
    p2p_ms: float
    offload_ms: float
    compute_ms: float
    step_ms: float
    fits: bool


def derive_model(params: float, layers: int | None = None, hidden: int | None = None,
                 heads: int | None = None, seq: int = 2048) -> Model:
    """Fill in a GPT shape for `params` where not given: P ~= 12 * layers * hidden^2, hidden/layers
    ~= 128 (GPT-3's ratio), layers a multiple of 8, hidden a multiple of 1024, 128-wide heads."""
    if params <= 0:
        raise PlanError(f"--params {params:g}: give the model's parameter count, e.g. 13e9")
    if seq <= 0:
        raise PlanError(f"--seq {seq}: the sequence length must be positive")
    if layers is None and hidden is None:
        h0 = (128 * params / 12) ** (1 / 3)
        layers = max(8, 8 * round(params / (12 * h0 * h0) / 8))
    if hidden is None:
        hidden = max(1024, 1024 * round(math.sqrt(params / (12 * layers)) / 1024))
    if layers is None:
        layers = max(1, round(params / (12 * hidden * hidden)))
    if heads is None:
        heads = max(1, hidden // 128)
    if layers < 1 or hidden < 1 or heads < 1 or hidden % heads:
        raise PlanError(f"--layers {layers} --hidden {hidden} --heads {heads}: need positive sizes, "
                        "heads dividing hidden")
    return Model(params=float(params), layers=int(layers), hidden=int(hidden), heads=int(heads), seq=int(seq))


def state_bytes_per_param(zero_stage: int, dp: int, offload: str) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per parameter held by a GPU (tp/pp split already done)."""
    w, g, o = float(BYTES_WEIGHT), float(BYTES_GRAD), float(BYTES_OPTIM)
    if zero_stage >= 1:
        o /= dp
    if zero_stage >= 2:
        g /= dp
    if zero_stage >= 3:
        w /= dp
    if offload == "cpu":
        o = 0.0
        if zero_stage >= 3:
            w = 0.0
    return w, g, o


def activation_bytes_per_layer(model: Model, micro_batch: int, tp: int, recompute: bool) -> float:
    """Korthikanti et al. 2022, eq. (2) with TP (no sequence parallel); 2sbh with full recompute."""
    s, b, h, a = model.seq, micro_batch, model.hidden, model.heads
    if recompute:
        return 2.0 * s * b * h
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def memory_per_gpu(model: Model, tp: int, pp: int, dp: int, zero_stage: int, offload: str,
                   micro_batch: int, micro_batches: int, recompute: bool) -> Memory:
    """The heaviest GPU's memory (the first pipeline stage), in GB."""
    held = model.params / (tp * pp)
    w, g, o = state_bytes_per_param(zero_stage, dp, offload)
    if offload == "cpu" and zero_stage >= 3:
        w = BYTES_WEIGHT * (model.params / model.layers / tp) / held  # one layer's weights on the GPU
    layers_per_stage = model.layers // pp
    in_flight = min(pp, micro_batches)
    act = layers_per_stage * in_flight * activation_bytes_per_layer(model, micro_batch, tp, recompute)
    return Memory(held * w / GB, held * g / GB, held * o / GB, act / GB)


def bubble(pp: int, micro_batches: int) -> float:
    """The balanced-1F1B floor (p - 1) / (m + p - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def ring_factor(zero_stage: int, dp: int) -> float:
    """Bytes on the wire per gradient byte, in NCCL-tests busbw terms (time = factor * bytes / busbw
    with busbw = algbw * 2(n-1)/n for all-reduce): all-reduce or reduce-scatter + all-gather =
    2(n-1)/n; ZeRO-3 also all-gathers the parameters for the backward pass: 3(n-1)/n."""
    if dp <= 1:
        return 0.0
    return (3.0 if zero_stage >= 3 else 2.0) * (dp - 1) / dp


def grad_sync_ms(model: Model, tp: int, pp: int, dp: int, zero_stage: int, busbw_gbps: float) -> float:
    grad_bytes = BYTES_GRAD * model.params / (tp * pp)
    return ring_factor(zero_stage, dp) * grad_bytes / (busbw_gbps * GB) * 1e3


def dp_busbw(cluster: Cluster, tp: int, dp: int) -> float:
    """Megatron's rank order puts TP innermost, then DP: the DP group stays inside a node when
    tp * dp <= gpus per node."""
    return cluster.intra_busbw_gbps if tp * dp <= cluster.gpus_per_node else cluster.inter_busbw_gbps


def check_cluster(cluster: Cluster) -> None:
    g, n = cluster.gpus, cluster.gpus_per_node
    if g < 1 or n < 1:
        raise PlanError(f"--gpus {g} --gpus-per-node {n}: both must be at least 1")
    if cluster.gpu_mem_gb <= 0:
        raise PlanError(f"--gpu-mem-gb {cluster.gpu_mem_gb:g}: must be positive")
    if g % n and n % g:
        near = sorted({max(n, g // n * n), (g // n + 1) * n})
        part = [d for d in range(1, n) if n % d == 0 and d < g]
        raise PlanError(
            f"--gpus {g} is neither whole nodes of {n} GPUs nor a part of one node that divides {n}: "
            f"use a multiple of {n} ({' or '.join(map(str, near))}), "
            + (f"{part[-1]} GPUs of one node, " if part else "")
            + "or set --gpus-per-node to match your nodes"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: Model, cluster: Cluster, global_batch: int,
               micro_batch_choices: tuple[int, ...] = (1, 2, 4, 8)) -> list[Plan]:
    """Every layout the rules allow, fitting or not, with its memory and time estimates."""
    check_cluster(cluster)
    g = cluster.gpus
    tokens = global_batch * model.seq
    out: list[Plan] = []
    node = min(cluster.gpus_per_node, g)
    for tp in _divisors(node):
        if model.heads % tp:
            continue
        for pp in _divisors(g // tp):
            if model.layers % pp:
                continue
            dp = g // (tp * pp)
            if global_batch % dp:
                continue
            for b in micro_batch_choices:
                if (global_batch // dp) % b:
                    continue
                m = global_batch // (dp * b)
                for zero in (0, 1) if pp > 1 else (0, 1, 2, 3):
                    for offload in ("none", "cpu") if (pp == 1 and zero >= 2) else ("none",):
                        for recompute in (False, True):
                            out.append(_plan(model, cluster, tp, pp, dp, zero, offload, recompute, b, m, tokens))
    return out


def _plan(model: Model, cluster: Cluster, tp: int, pp: int, dp: int, zero: int, offload: str,
          recompute: bool, b: int, m: int, tokens: int) -> Plan:
    mem = memory_per_gpu(model, tp, pp, dp, zero, offload, b, m, recompute)
    bub = bubble(pp, m)
    flops = (8.0 if recompute else 6.0) * model.params * tokens
    compute_ms = flops / (cluster.gpus * cluster.achieved_tflops * 1e12) * 1e3
    pipeline_ms = compute_ms / (1 - bub)
    if tp > 1:
        per_call = 2 * model.seq * b * model.hidden * 2.0 * (tp - 1) / tp  # bytes * 2(n-1)/n
        tp_ms = 4 * (model.layers // pp) * m * per_call / (cluster.intra_busbw_gbps * GB) * 1e3
    else:
        tp_ms = 0.0
    p2p_ms = 0.0
    if pp > 1:  # one activation forward and one gradient back per micro-batch on the 1F1B critical path
        # rank order tp, dp, pp: neighbouring stages are tp * dp ranks apart, in one node only
        # when the whole run is
        link = cluster.inter_busbw_gbps if cluster.gpus > cluster.gpus_per_node else cluster.intra_busbw_gbps
        p2p_ms = 2 * (m + pp - 1) * model.seq * b * model.hidden * 2.0 / (link * GB) * 1e3
    sync_ms = grad_sync_ms(model, tp, pp, dp, zero, dp_busbw(cluster, tp, dp))
    off_ms = 0.0
    if offload == "cpu":
        held = model.params / (tp * pp)
        shard = held / (dp if zero >= 2 else 1)
        off_ms = ((BYTES_GRAD + BYTES_WEIGHT) * shard / (cluster.host_gbps * GB)
                  + shard / cluster.cpu_adam_params_per_s) * 1e3
    step_ms = pipeline_ms + tp_ms + p2p_ms + sync_ms + off_ms
    return Plan(tp=tp, pp=pp, dp=dp, zero_stage=zero, offload=offload, recompute=recompute, micro_batch=b,
                micro_batches=m, memory=mem, bubble=bub, grad_sync_ms=sync_ms, tp_comm_ms=tp_ms, p2p_ms=p2p_ms,
                offload_ms=off_ms, compute_ms=compute_ms, step_ms=step_ms,
                fits=mem.total_gb <= cluster.budget_gb)


def rank(plans: list[Plan]) -> list[Plan]:
    """Fitting plans, fastest estimated step first; ties go to no offload, no recomputation, less
    memory per GPU, fewer stages, narrower TP (less to go wrong)."""
    fit = [p for p in plans if p.fits]
    return sorted(fit, key=lambda p: (round(p.step_ms, 3), p.offload != "none", p.recompute,
                                      round(p.memory.total_gb, 3), p.pp, p.tp, -p.micro_batch))


def plan(model: Model, cluster: Cluster, global_batch: int, top: int = 5) -> list[Plan]:
    """The best `top` plans, one per (tp, pp, zero, offload, recompute) shape (its best micro-batch).
    Raises PlanError with what would fit when none does."""
    if global_batch < 1:
        raise PlanError(f"--global-batch {global_batch}: must be at least 1")
    all_plans = candidates(model, cluster, global_batch)
    if not all_plans:
        raise PlanError(
            f"no layout of {cluster.gpus} GPUs divides the model ({model.derived_note}) and the global batch "
            f"{global_batch}: pick a --global-batch that is a multiple of {cluster.gpus} (or of the DP size you want) "
            "and --layers with small factors"
        )
    ranked = rank(all_plans)
    if not ranked:
        raise PlanError(_nothing_fits(model, cluster, global_batch, all_plans))
    seen, best = set(), []
    for p in ranked:
        key = (p.tp, p.pp, p.zero_stage, p.offload, p.recompute)
        if key in seen:
            continue
        seen.add(key)
        best.append(p)
        if len(best) == top:
            break
    return best


def _nothing_fits(model: Model, cluster: Cluster, global_batch: int, all_plans: list[Plan]) -> str:
    least = min(all_plans, key=lambda p: p.memory.total_gb)
    msg = (f"the model ({model.params:.3g} parameters; {model.derived_note}) fits no layout of {cluster.gpus} GPUs "
           f"with {cluster.gpu_mem_gb:g} GB each ({cluster.budget_gb:.1f} GB usable): the smallest needs "
           f"{least.memory.total_gb:.1f} GB per GPU (tp={least.tp} pp={least.pp} dp={least.dp} "
           f"zero={least.zero_stage} offload={least.offload} recompute={least.recompute})")
    n = cluster.gpus_per_node
    for nodes in _growth(max(1, cluster.gpus // n)):
        more = dataclasses.replace(cluster, gpus=nodes * n)
        gb = max(global_batch, nodes * n)
        try:
            if rank(candidates(model, more, gb)):
                return msg + f"; it would fit on {nodes * n} GPUs ({nodes} nodes of {n})" + (
                    f" with --global-batch {gb}" if gb != global_batch else "")
        except PlanError:
            continue
    need = least.memory.total_gb / (1 - cluster.reserve_frac)
    return msg + f"; it would need GPUs of at least {need:.0f} GB (--gpu-mem-gb)"


def _growth(start: int):
    nodes = start
    while nodes <= 8192:
        nodes *= 2
        yield nodes


# ----------------------------------------------------------------------------- launch commands


def trainer_flags(p: Plan) -> list[str]:
    flags = ["--tp", str(p.tp), "--pp", str(p.pp), "--zero", str(p.zero_stage), "--offload", p.offload,
             "--micro-batch", str(p.micro_batch), "--micro-batches", str(p.micro_batches), "--dtype", "bf16"]
    return flags


def launch_commands(p: Plan, cluster: Cluster) -> dict[str, str]:
    """torchrun, the deepspeed launcher and an sbatch script for the plan, running the reference
    trainer's module (swap `-m reference_trainer` for your own training script)."""
    n = min(cluster.gpus_per_node, cluster.gpus)
    nodes = max(1, cluster.gpus // n)
    flags = " ".join(trainer_flags(p))
    if nodes == 1:
        torchrun = f"torchrun --standalone --nproc_per_node {n} -m reference_trainer {flags}"
    else:
        torchrun = (f"torchrun --nnodes {nodes} --nproc_per_node {n} --rdzv_backend c10d "
                    f"--rdzv_endpoint $MASTER_ADDR:29500 --rdzv_id tracetop -m reference_trainer {flags}")
    deepspeed = (f"deepspeed --hostfile hostfile --num_nodes {nodes} --num_gpus {n} "
                 f"--module reference_trainer {flags}")
    sbatch = "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name=tracetop-tp{p.tp}-pp{p.pp}-dp{p.dp}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={n}",
        "#SBATCH --exclusive",
        "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        f"srun torchrun --nnodes {nodes} --nproc_per_node {n} --rdzv_backend c10d "
        f"--rdzv_endpoint $MASTER_ADDR:29500 --rdzv_id $SLURM_JOB_ID -m reference_trainer {flags}",
    ])
    tracetop_train = (f"tracetop train --nproc {n}" + (f" --nnodes {nodes} --rdzv-endpoint $MASTER_ADDR:29500"
                                                       if nodes > 1 else "") + f" {flags}")
    return {"torchrun": torchrun, "deepspeed": deepspeed, "sbatch": sbatch, "tracetop_train": tracetop_train,
            "trainer_flags": flags}


def to_dict(p: Plan, cluster: Cluster) -> dict:
    cmds = launch_commands(p, cluster)
    return {
        "tp": p.tp, "pp": p.pp, "dp": p.dp, "zero_stage": p.zero_stage, "offload": p.offload,
        "offload_needed": p.offload != "none", "recompute": p.recompute,
        "micro_batch": p.micro_batch, "micro_batches": p.micro_batches,
        "memory_per_gpu_gb": round(p.memory.total_gb, 2),
        "memory_gb": {"weights": round(p.memory.weights_gb, 3), "grads": round(p.memory.grads_gb, 3),
                      "optimizer": round(p.memory.optimizer_gb, 3), "activations": round(p.memory.activations_gb, 3)},
        "budget_gb": round(cluster.budget_gb, 2),
        "bubble": round(p.bubble, 4),
        "grad_sync_ms": round(p.grad_sync_ms, 1),
        "grad_sync_busbw_gbps": dp_busbw(cluster, p.tp, p.dp),
        "tp_comm_ms": round(p.tp_comm_ms, 1), "p2p_ms": round(p.p2p_ms, 1), "offload_ms": round(p.offload_ms, 1),
        "compute_ms": round(p.compute_ms, 1), "step_ms": round(p.step_ms, 1),
        "command": cmds["torchrun"], "commands": cmds,
    }
