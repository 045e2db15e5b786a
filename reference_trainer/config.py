"""Command-line flags, model-size presets, parallel layouts and the DeepSpeed config.

Pure functions only (no torch, no deepspeed): ``tracetop train`` validates a layout before it
starts torchrun, and the tests check the rules directly.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tracetop.errors import TracetopError

# ----------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """A GPT-style decoder's shape. ``ffn`` is the MLP's inner width."""

    name: str
    vocab: int
    seq_len: int
    hidden: int
    n_layers: int
    n_heads: int
    ffn: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


PRESETS: dict[str, ModelPreset] = {
    # CPU tests: ~0.2M parameters, a step in tens of ms on gloo.
    "tiny": ModelPreset("tiny", vocab=64, seq_len=32, hidden=64, n_layers=4, n_heads=4, ffn=256),
    # CPU demos / quick GPU smoke tests: ~7M parameters.
    "small": ModelPreset("small", vocab=512, seq_len=128, hidden=256, n_layers=8, n_heads=8, ffn=1024),
    # GPU benchmarks. Parameter counts include the (untied) embedding and head.
    "125m": ModelPreset("125m", vocab=50304, seq_len=1024, hidden=768, n_layers=12, n_heads=12, ffn=3072),
    "350m": ModelPreset("350m", vocab=50304, seq_len=1024, hidden=1024, n_layers=24, n_heads=16, ffn=4096),
    "1b": ModelPreset("1b", vocab=50304, seq_len=1024, hidden=2048, n_layers=18, n_heads=16, ffn=8192),
}


def n_params(p: ModelPreset) -> int:
    """Total parameters of the model (all stages, unsharded)."""
    emb = p.vocab * p.hidden + p.seq_len * p.hidden
    block = (
        2 * 2 * p.hidden  # two LayerNorms (weight + bias)
        + 3 * p.hidden * p.hidden + 3 * p.hidden  # fused q/k/v
        + p.hidden * p.hidden + p.hidden  # attention output
        + p.ffn * p.hidden + p.ffn  # MLP in
        + p.hidden * p.ffn + p.hidden  # MLP out
    )
    head = 2 * p.hidden + p.vocab * p.hidden  # final LayerNorm + untied output projection
    return emb + p.n_layers * block + head


def flops_per_token(p: ModelPreset) -> int:
    """Training FLOPs per token (forward + backward = 3x forward), Megatron's convention:
    6 x (matmul parameters) + 12 x layers x hidden x seq_len for attention scores and values.
    Embedding lookups, norms and elementwise work are not counted."""
    matmul_params = p.n_layers * (4 * p.hidden * p.hidden + 2 * p.hidden * p.ffn) + p.vocab * p.hidden
    return 6 * matmul_params + 12 * p.n_layers * p.hidden * p.seq_len


# ----------------------------------------------------------------------------- layouts


class LayoutError(TracetopError, ValueError):
    """A parallel layout that cannot run; the message says why and what to use instead."""


@dataclasses.dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    dp: int
    zero: int
    offload: str  # none | cpu | nvme

    @property
    def shape(self) -> str:
        """``3d``: PipelineModule x TP x DP with ZeRO 0/1. ``zero``: TP x DP without a pipeline, for
        ZeRO 2/3 and for offload."""
        return "zero" if self.zero >= 2 or self.offload != "none" else "3d"


def make_layout(world_size: int, tp: int, pp: int, zero: int, offload: str, preset: ModelPreset) -> Layout:
    """Check a layout against the world size, the model and DeepSpeed's rules; DP is derived."""
    if tp < 1 or pp < 1:
        raise LayoutError(f"--tp {tp} --pp {pp}: both must be at least 1")
    if zero not in (0, 1, 2, 3):
        raise LayoutError(f"--zero {zero}: ZeRO stages are 0, 1, 2 or 3")
    if offload not in ("none", "cpu", "nvme"):
        raise LayoutError(f"--offload {offload}: use none, cpu or nvme")
    if world_size % (tp * pp) != 0:
        raise LayoutError(
            f"TP x PP = {tp} x {pp} = {tp * pp} does not divide the world size {world_size}: "
            f"TP x PP x DP must equal the number of processes; launch a multiple of {tp * pp} processes "
            f"(e.g. --nproc_per_node {tp * pp * max(1, world_size // (tp * pp))}) or change --tp/--pp"
        )
    dp = world_size // (tp * pp)
    if pp > 1 and zero >= 2:
        raise LayoutError(
            f"--pp {pp} with --zero {zero}: DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3 "
            "('ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism'); use --zero 1 with a "
            "pipeline, or --pp 1 with --zero 2/3 (the ZeRO shape: TP x DP)"
        )
    if offload != "none" and zero == 0:
        raise LayoutError(
            f"--offload {offload} needs ZeRO: DeepSpeed offloads the optimizer only with ZeRO 1-3; "
            "add --zero 2 (or --zero 3 to offload parameters too)"
        )
    if offload != "none" and pp > 1:
        raise LayoutError(
            f"--offload {offload} with --pp {pp}: offload is the ZeRO shape's job here; "
            "use --pp 1 --zero 2 (or 3) with --offload, or drop --offload for the pipeline"
        )
    if preset.n_heads % tp != 0 or preset.ffn % tp != 0:
        raise LayoutError(
            f"--tp {tp} does not divide the '{preset.name}' model's {preset.n_heads} attention heads "
            f"and MLP width {preset.ffn}; use a --tp that divides both"
        )
    if pp > preset.n_layers:
        raise LayoutError(
            f"--pp {pp} is more stages than the '{preset.name}' model's {preset.n_layers} blocks; "
            "use fewer stages or a bigger --model"
        )
    return Layout(world_size=world_size, tp=tp, pp=pp, dp=dp, zero=zero, offload=offload)


# ----------------------------------------------------------------------------- DeepSpeed config


def ds_config(
    layout: Layout,
    *,
    micro_batch: int,
    micro_batches: int,
    lr: float,
    bf16: bool,
    nvme_path: str | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config for a layout. Always torch's AdamW (``torch_adam``): no compiled op is
    built, and ZeRO-Offload runs it on the host (``zero_force_ds_cpu_optimizer: false``)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batch * micro_batches * layout.dp,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
        },
        "zero_optimization": {"stage": layout.zero},
        "steps_per_print": 10**9,  # the trainer prints its own line per step
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    zo = cfg["zero_optimization"]
    if layout.offload == "cpu":
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if layout.zero == 3:
            zo["offload_param"] = {"device": "cpu", "pin_memory": False}
        cfg["zero_force_ds_cpu_optimizer"] = False
    elif layout.offload == "nvme":
        path = nvme_path or "/tmp/reference_trainer_nvme"
        zo["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "pin_memory": True}
        if layout.zero == 3:
            zo["offload_param"] = {"device": "nvme", "nvme_path": path, "pin_memory": True}
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


# ----------------------------------------------------------------------------- flags


def add_trainer_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``python -m reference_trainer`` (also accepted by ``tracetop train``)."""
    g = p.add_argument_group("layout")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    g.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage (default 1)")
    g.add_argument("--offload", default="none", choices=("none", "cpu", "nvme"),
                   help="optimizer (and with ZeRO 3, parameter) offload; needs --pp 1 --zero >= 1")
    g.add_argument("--nvme-path", default=None, help="folder for --offload nvme")
    g = p.add_argument_group("run")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model size preset (default tiny)")
    g.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch per DP rank (default 4)")
    g.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches per step (gradient accumulation; default 4)")
    g.add_argument("--steps", type=int, default=20, help="train until this global step (default 20)")
    g.add_argument("--seed", type=int, default=1234, help="weights and data seed (default 1234)")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    g.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="auto: bf16 on GPU, fp32 on CPU")
    g.add_argument("--stop-file", default=None, metavar="PATH",
                   help="end cleanly before the step number written in PATH (every rank at the same step, "
                   "exit 0, hooks closed, checkpoint saved with --save-dir); write it whole (write, then "
                   "rename); a step not ahead of the run ends it at the next step boundary. Rank 0 reads "
                   "it and broadcasts it every step (one CPU collective a step, only with this flag)")
    g.add_argument("--dist-timeout-s", type=float, default=600.0,
                   help="timeout of every process group's collectives, seconds (default 600)")
    g = p.add_argument_group("output")
    g.add_argument("--log-jsonl", default=None, help="rank 0 appends one JSON line per step here")
    g.add_argument("--rank-log-dir", default=None,
                   help="every rank writes rank<N>.jsonl here: its own step, phase and memory figures")
    g.add_argument("--no-trace", action="store_true", help="do not start tracetop's hooks")
    g.add_argument("--quiet", action="store_true", help="no per-step line on stdout")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-dir", default=None, help="DeepSpeed checkpoint folder")
    g.add_argument("--save-every", type=int, default=0, help="save after every N steps (0: only at the end)")
    g.add_argument("--load-dir", default=None, help="resume from a checkpoint in this folder")
    g.add_argument("--load-tag", default=None, help="which checkpoint (e.g. step30; default: the latest)")
    g = p.add_argument_group("adjustments (applied on all ranks at a step boundary)")
    g.add_argument("--adjust", action="append", default=[], metavar="STEP:KEY=VALUE",
                   help="before STEP: micro_batch=N (global batch kept), offload=on|off, or rebalance=N,N,... "
                   "(samples per data-parallel replica, summing to the global batch); repeatable")
    g = p.add_argument_group("fault injection (real effects)")
    g.add_argument("--inject-straggler", action="append", default=[], metavar="RANK:MS[@STEP]",
                   help="that rank computes MS longer every step (inside its forward) from STEP")
    g.add_argument("--inject-slow-rank", action="append", default=[], metavar="RANK:FACTOR[@STEP]",
                   help="from STEP that rank sleeps (FACTOR - 1) x its median step time before STEP, every step, "
                   "inside its forward: a straggler proportional to the step")
    g.add_argument("--inject-slow-samples", action="append", default=[], metavar="RANK:FACTOR@STEP[-END]",
                   help="from STEP (until before END) that rank is FACTOR x slower per sample: in each forward it "
                   "sleeps (FACTOR - 1) x its median step time per sample before STEP, x the samples of that "
                   "micro-batch (a straggler that fewer samples relieve: the rebalance's fault)")
    g.add_argument("--inject-comm-delay", action="append", default=[], metavar="RANK:MS[@STEP]",
                   help="that rank enters its data-parallel gradient reduction MS late every step")
    g.add_argument("--inject-stage-imbalance", action="append", default=[], metavar="STAGE:FACTOR[@STEP]",
                   help="that pipeline stage's forward and backward take FACTOR times longer")
    g.add_argument("--inject-mem-growth", action="append", default=[], metavar="RANK:MB[@STEP]",
                   help="that rank allocates and holds MB more every step")
    g.add_argument("--inject-hang", action="append", default=[], metavar="RANK@STEP",
                   help="that rank stops inside a collective at STEP; the others block until the timeout")
    g.add_argument("--inject-kill", action="append", default=[], metavar="RANK@STEP",
                   help="that rank kills itself (SIGKILL, no clean exit) in its first forward of STEP")
    g.add_argument("--inject-slow-micro-batch", action="append", default=[], metavar="MB:MS|MB:xF",
                   help="while the micro-batch size is MB, every rank's step is MS longer, or F x its step "
                   "at its other sizes (proportional: holds on a loaded host)")
    g.add_argument("--inject-refuse-command", action="append", default=[], metavar="RANK[:KEY=VALUE]",
                   help="that rank refuses commands from the control path (all, or only KEY=VALUE)")
    g.add_argument("--sample-ms", type=float, default=0.0,
                   help="every rank sleeps MS per sample in each forward: device time that scales with the samples, "
                   "for CPU tests whose tiny model's compute is lost in a loaded host's noise (default 0)")
    g = p.add_argument_group("memory")
    g.add_argument("--activation-mb-per-sample", type=float, default=0.0,
                   help="every forward holds MB x micro-batch of touched memory until its backward, as "
                   "activations do (so the step's peak scales with the micro-batch; default 0)")
    g.add_argument("--memory-budget-mb", type=float, default=None,
                   help="the memory budget the hooks report beside each step's peak (MiB per rank)")


def to_argv(args: argparse.Namespace) -> list[str]:
    """The trainer flags of ``args`` that differ from their defaults, as command-line words."""
    ref = argparse.ArgumentParser(add_help=False)
    add_trainer_arguments(ref)
    out: list[str] = []
    for action in ref._actions:
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out
