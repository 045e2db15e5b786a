"""Simulated snapshots of a large run (thousands of ranks) for `tracetop bench tui` and the
scale tests. Same sections and columns as collector/query/snapshot.py builds; values drawn around a
step time with one slow rank, so the screens have something real to aggregate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np

from collector.query import snapshot as snapmod


def layout(n_ranks: int) -> tuple[int, int, int]:
    """(tp, pp, dp) for n_ranks: TP 8 and PP up to 16 where they divide, the rest DP."""
    tp = 8 if n_ranks % 8 == 0 and n_ranks >= 64 else 1
    pp = 1
    for p in (16, 8, 4, 2):
        if n_ranks % (tp * p) == 0 and n_ranks // (tp * p) >= 2:
            pp = p
            break
    return tp, pp, n_ranks // (tp * pp)


def snapshot(n_ranks: int, step: int = 100, *, slow_rank: int | None = None, seed: int = 0,
             gpus_per_node: int = 8) -> snapmod.Snapshot:
    import pyarrow as pa

    rng = np.random.default_rng(seed + step)
    tp, pp, dp = layout(n_ranks)
    rank = np.arange(n_ranks, dtype=np.int64)
    stage = rank // (dp * tp)
    replica = (rank // tp) % dp
    tp_rank = rank % tp
    node = np.array([f"node{r // gpus_per_node:05d}" for r in rank], dtype=object)
    compute = 120 + rng.normal(0, 2, n_ranks)
    slow = n_ranks // 3 if slow_rank is None else slow_rank
    compute[slow] += 80
    wait = 200 - compute + rng.normal(0, 1, n_ranks)
    step_ms = compute + wait
    ranks = pa.table({
        "rank": rank.astype(np.int32), "stage": stage.astype(np.int32), "replica": replica.astype(np.int32),
        "tp_rank": tp_rank.astype(np.int32), "node": node.tolist(), "step_ms": step_ms, "compute_ms": compute,
        "wait_ms": wait, "data_wait_ms": rng.uniform(0, 1, n_ranks), "forward_ms": compute * 0.33,
        "backward_ms": compute * 0.6, "optimizer_ms": compute * 0.07, "comm_exposed_ms": wait * 0.5,
        "mem_bytes": 40e9 + rng.normal(0, 1e8, n_ranks), "mem_budget_bytes": np.full(n_ranks, 80e9),
        "gpu_util_pct": 90 - wait / 10, "reported": np.ones(n_ranks, dtype=np.int32),
    })
    steps = np.arange(max(step - 29, 0), step + 1)
    k = steps.size
    steps_t = pa.table({
        "step": steps, "ranks": np.full(k, n_ranks), "step_ms_p50": np.full(k, 200.0) + rng.normal(0, 2, k),
        "step_ms_max": np.full(k, 210.0), "data_wait_ms": np.full(k, 0.5), "forward_ms": np.full(k, 40.0),
        "backward_ms": np.full(k, 72.0), "optimizer_ms": np.full(k, 8.0), "comm_exposed_ms": np.full(k, 40.0),
        "compute_ms": np.full(k, 120.0), "tokens": np.full(k, n_ranks * 4096), "samples": np.full(k, n_ranks * 4),
        "tokens_per_s": np.full(k, n_ranks * 4096 / 0.2), "mfu": np.full(k, 0.41),
        "grad_sync_ms_p99": np.full(k, 150.0) + rng.normal(0, 10, k),
    })
    bubble = pa.table({
        "stage": np.tile(np.arange(pp), k), "step": np.repeat(steps, pp),
        "bubble_rate": np.clip(rng.normal(0.2, 0.05, pp * k), 0, 1),
        "ideal_bubble_rate": np.full(pp * k, snapmod_ideal(pp, 8)),
    })
    n_nodes = max(n_ranks // gpus_per_node, 1)
    g_node = np.repeat([f"node{i:05d}" for i in range(n_nodes)], gpus_per_node).tolist()
    ng = len(g_node)
    gpus = pa.table({
        "node": g_node, "gpu": np.tile(np.arange(gpus_per_node), n_nodes).astype(np.int32), "uuid": [""] * ng,
        "util_pct": rng.uniform(60, 100, ng), "mem_used_bytes": np.full(ng, 60e9), "mem_total_bytes": np.full(ng, 80e9),
        "temp_c": rng.uniform(50, 80, ng), "power_mw": np.full(ng, 6e5), "clock_event_reasons": np.zeros(ng),
        "ecc_uncorrected": np.zeros(ng), "sampled_ns": np.full(ng, time.time_ns()),
    })
    header = {"run_id": "simulated", "source": "sim", "step": int(step), "window_lo": int(steps[0]),
              "first_step": 0, "last_step": int(step), "step_end_ns": time.time_ns(), "taken_ns": time.time_ns(),
              "world_size": n_ranks, "ranks_started": n_ranks, "nodes": n_nodes, "tp": tp, "pp": pp, "dp": dp,
              "zero_stage": 1, "model_name": "sim", "n_params": 0, "micro_batch": 1, "micro_batches": 8,
              "offload": "none", "has_alerts": False, "has_actions": False}
    return snapmod.Snapshot(header, {"ranks": ranks, "steps": steps_t, "bubble": bubble, "gpus": gpus})


def snapmod_ideal(pp: int, m: int) -> float:
    return (pp - 1) / (m + pp - 1) if pp > 1 else 0.0


class SimSource:
    """A live Source of simulated snapshots at the asked rate (the bench's workload; the TUI does
    the same work per snapshot as with a collector, minus decoding)."""

    live = True

    def __init__(self, n_ranks: int) -> None:
        self.n_ranks = n_ranks
        self.description = f"simulated {n_ranks} ranks"
        self.run_id = "simulated"
        self.sent = 0
        # a few prebuilt snapshots, so the bench measures the TUI, not the generator
        self._snaps = [snapshot(n_ranks, step=100 + i) for i in range(4)]

    is_open = True  # nothing to open: the snapshots are prebuilt

    def open(self) -> None:
        pass

    def watch(self, interval_s: float, stop: threading.Event) -> Iterator[snapmod.Snapshot]:
        while not stop.is_set():
            s = self._snaps[self.sent % len(self._snaps)]
            self.sent += 1
            yield s
            if stop.wait(interval_s):
                return

    def snapshot_at(self, step: int | None) -> snapmod.Snapshot:
        return self._snaps[0]

    def rank_detail(self, rank: int, step: int) -> dict:
        import pyarrow as pa

        return {"steps": pa.table({"step": [step]}), "collectives": pa.table({})}

    def close(self) -> None:
        pass
