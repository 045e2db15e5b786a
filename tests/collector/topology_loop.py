"""A 4-rank gloo loop on two node names, for the comm_topology tests (tests/collector/test_dashboard.py).

    torchrun --standalone --nproc_per_node 4 tests/collector/topology_loop.py --steps 16 --delay-ms 60

Ranks 0, 1 call themselves node-a and ranks 2, 3 node-b (TRACETOP_NODE, set per rank before the
Tracer reads it: the node name the hooks report instead of the host's).
Layout tp=2 x dp=2: the TP groups (0,1) and (2,3) stay in a node, the DP groups (0,2) and (1,3)
cross. Each step: an all-reduce in the rank's TP group, then one in its DP group; from the first
step, rank 3 sleeps --delay-ms before its DP all-reduce, so the pair (1,3)'s transfers are late and
rank 1's all-reduce on the node-a → node-b link waits that long.
"""

from __future__ import annotations

import argparse
import os
import time

RANK = int(os.environ.get("RANK", "0"))
NODE = "node-a" if RANK < 2 else "node-b"
os.environ["TRACETOP_NODE"] = NODE  # before the Tracer reads it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--delay-ms", type=float, default=60.0)
    a = ap.parse_args()
    import torch
    import torch.distributed as dist

    import trainer_hooks

    dist.init_process_group("gloo")
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tracer = trainer_hooks.Tracer(heartbeat_s=1)
    tracer.set_topology({"tp": [(0, 1), (2, 3)], "dp": [(0, 2), (1, 3)]})
    tracer.describe(tp=2, pp=1, dp=2, model_name="topology-loop")
    tp, dp = tp_groups[RANK // 2], dp_groups[RANK % 2]
    t = torch.ones(16384)  # 64 KiB
    for step in range(a.steps):
        with tracer.step(step):
            with tracer.phase("forward"):
                dist.all_reduce(t, group=tp)
            if RANK == 3:
                time.sleep(a.delay_ms / 1e3)
            with tracer.phase("backward"):
                dist.all_reduce(t, group=dp)
            t.fill_(1.0)
    tracer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
