"""``tracetop train --nproc N ...``: the reference trainer through torchrun.

Checks the layout first (so an impossible one fails before N processes start), then replaces
this process with ``python -m torch.distributed.run ... -m reference_trainer <trainer flags>``.
Every ``python -m reference_trainer`` flag is accepted here and passed through.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from reference_trainer.config import PRESETS, LayoutError, add_trainer_arguments, make_layout, to_argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch (torchrun)")
    g.add_argument("--nproc", type=int, required=True, help="processes on this node (torchrun --nproc_per_node)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes in the run (default 1)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's index (static rendezvous)")
    g.add_argument("--rdzv-endpoint", default=None,
                   help="HOST:PORT of the rendezvous for multi-node runs (c10d backend)")
    g.add_argument("--rdzv-id", default="tracetop-train", help="rendezvous id (default tracetop-train)")
    g.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    add_trainer_arguments(parser)


def torchrun_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
    if args.nnodes == 1 and not args.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(args.nnodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", str(args.rdzv_endpoint),
                "--rdzv_id", args.rdzv_id]
        if args.node_rank is not None:
            cmd += ["--node_rank", str(args.node_rank)]
    return cmd + ["-m", "reference_trainer", *to_argv(args)]


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1 or args.nnodes < 1:
        print("tracetop train: --nproc and --nnodes must be at least 1", file=sys.stderr)
        return 2
    if args.nnodes > 1 and not args.rdzv_endpoint:
        print("tracetop train: --nnodes > 1 needs --rdzv-endpoint HOST:PORT (a host every node reaches)",
              file=sys.stderr)
        return 2
    try:
        make_layout(args.nproc * args.nnodes, args.tp, args.pp, args.zero, args.offload, PRESETS[args.model])
    except LayoutError as e:
        print(f"tracetop train: {e}", file=sys.stderr)
        return 2
    cmd = torchrun_command(args)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached
