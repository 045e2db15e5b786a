"""`tracetop plan --params 13e9 --gpus 512 [...] [--json]`: ranked TP x PP x DP plans and how to launch them.

The arithmetic is in reference_trainer/plan.py (its docstring states the memory and time model). Exit 2
when no plan exists, with why and what would fit.
"""

from __future__ import annotations

import argparse
import json
import sys


def _count(text: str) -> float:
    try:
        v = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 13e9)") from e
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=_count, required=True, help="model parameters, e.g. 13e9")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the run")
    parser.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU (default 80)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; TP stays inside one (default 8)")
    parser.add_argument("--layers", type=int, default=None, help="transformer layers (default: derived from --params)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: derived from --params)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/128)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--global-batch", type=int, default=1024, help="sequences per optimizer step (default 1024)")
    parser.add_argument("--busbw-gbps", type=float, default=40.0,
                        help="NCCL bus bandwidth across nodes, for the grad-sync estimate (default 40)")
    parser.add_argument("--intra-busbw-gbps", type=float, default=150.0,
                        help="NCCL bus bandwidth inside a node (NVLink; default 150)")
    parser.add_argument("--achieved-tflops", type=float, default=150.0,
                        help="bf16 TFLOP/s a GPU achieves on the model's matmuls (default 150)")
    parser.add_argument("--reserve", type=float, default=0.10,
                        help="fraction of GPU memory kept free for allocator/workspaces (default 0.10)")
    parser.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    parser.add_argument("--json", action="store_true", help='print {"plans": [...]} best first')


def run(args: argparse.Namespace) -> int:
    from reference_trainer.plan import Cluster, PlanError, derive_model, launch_commands, plan, to_dict

    try:
        if args.top < 1:
            raise PlanError(f"--top {args.top}: must be at least 1")
        if not 0 <= args.reserve < 1:
            raise PlanError(f"--reserve {args.reserve}: a fraction in [0, 1)")
        model = derive_model(args.params, args.layers, args.hidden, args.heads, args.seq)
        cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem_gb,
                          reserve_frac=args.reserve, achieved_tflops=args.achieved_tflops,
                          intra_busbw_gbps=args.intra_busbw_gbps, inter_busbw_gbps=args.busbw_gbps)
        plans = plan(model, cluster, args.global_batch, top=args.top)
    except PlanError as e:
        print(f"tracetop plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump({"model": {"params": model.params, "layers": model.layers, "hidden": model.hidden,
                             "heads": model.heads, "seq": model.seq},
                   "cluster": {"gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node,
                               "gpu_mem_gb": cluster.gpu_mem_gb, "budget_gb": round(cluster.budget_gb, 2)},
                   "global_batch": args.global_batch,
                   "plans": [to_dict(p, cluster) for p in plans]}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(f"model: {model.params:.3g} parameters, {model.derived_note}; global batch {args.global_batch}")
    print(f"cluster: {cluster.gpus} GPUs, {cluster.gpus_per_node} per node, {cluster.gpu_mem_gb:g} GB each "
          f"({cluster.budget_gb:.1f} GB usable)")
    print()
    head = ["#", "tp", "pp", "dp", "zero", "offload", "recomp", "mb", "m", "GB/GPU", "bubble", "sync ms", "step ms"]
    rows = [[str(i + 1), str(p.tp), str(p.pp), str(p.dp), str(p.zero_stage), p.offload,
             "yes" if p.recompute else "no", str(p.micro_batch), str(p.micro_batches),
             f"{p.memory.total_gb:.1f}", f"{p.bubble:.3f}", f"{p.grad_sync_ms:.0f}", f"{p.step_ms:.0f}"]
            for i, p in enumerate(plans)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    best = plans[0]
    m = best.memory
    print()
    print(f"best: tp={best.tp} pp={best.pp} dp={best.dp}, ZeRO {best.zero_stage}, offload {best.offload}, "
          f"recompute {'on' if best.recompute else 'off'}: {m.total_gb:.1f} GB per GPU = weights "
          f"{m.weights_gb:.1f} + grads {m.grads_gb:.1f} + optimizer {m.optimizer_gb:.1f} + activations "
          f"{m.activations_gb:.1f}")
    print(f"  bubble (p-1)/(m+p-1) = {best.bubble:.3f}; grad-sync ~{best.grad_sync_ms:.0f} ms per step; "
          f"estimated step {best.step_ms:.0f} ms (compute {best.compute_ms:.0f} ms)")
    cmds = launch_commands(best, cluster)
    print()
    print("launch (reference trainer; put your own script in place of -m reference_trainer):")
    print(f"  {cmds['torchrun']}")
    print(f"  {cmds['deepspeed']}")
    print(f"  {cmds['tracetop_train']}")
    print("sbatch script:")
    print("\n".join("  " + line for line in cmds["sbatch"].splitlines()))
    return 0
