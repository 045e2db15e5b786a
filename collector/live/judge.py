"""From one completed step of a run's live state to observations per rule: pure, no I/O, no clock.

`step_view(run, step)` copies the step's figures out of the ring (plain arrays over the ranks that
reported), `step_figures` computes every per-step signal once, and `observe(rule, figures)` turns
them into the rule's observations: one per scope instance (a rank, a stage, the run), each with
its value in the rule's unit, whether it breaches, and a message. The engine (engine.py) adds the
hold, hysteresis and state; `tracetop alerts --recompute` runs the same code over stored rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from collector.live import lost as lost_mod
from collector.live import signals as sg
from collector.live.rules import Rule
from collector.live.state import F, RunState

NAN = math.nan


@dataclass(frozen=True)
class StepView:
    run_id: str
    step: int
    rank: np.ndarray          # ranks that reported this step
    stage: np.ndarray
    missing: tuple[int, ...]  # expected ranks whose STEP row did not arrive by the deadline
    cols: dict[str, np.ndarray]
    best_p2p_bytes_per_ns: float
    dp: int
    world: int
    loss_history: np.ndarray  # the run's losses of earlier steps in the window (oldest first)
    end_ns: int = 0           # the latest end of the step's STEP rows (the ranks' clock)
    pp: int = 1
    micro_batches: int = -1   # the step's (STEP rows), else the run's (RUN_START)


def step_view(run: RunState, step: int) -> StepView | None:
    slot = run.slot_of(step)
    if slot < 0:
        return None
    idx = np.nonzero(run.present[slot])[0]
    if not len(idx):
        return None
    expected = run.expected_ranks()
    # (vectorised: a Python loop over 16,384 ranks a step cost milliseconds of every judgment)
    missing = tuple(np.nonzero(~run.present[slot, : min(expected, run.ranks)])[0].tolist()) + tuple(
        range(run.ranks, expected))
    # one copy of the slot (a view when every rank up to the last reported: the common case)
    block = run.data[slot, :, : len(idx)].copy() if idx[-1] == len(idx) - 1 else run.data[slot][:, idx]
    cols = {name: block[i] for name, i in F.items()}
    hist = []
    loss_row = F["loss"]
    for s in range(step - run.window + 1, step):
        sl = run.slot_of(s) if s >= 0 else -1
        if sl >= 0:
            losses = run.data[sl, loss_row]
            hit = np.nonzero(run.present[sl] & ~np.isnan(losses))[0]
            if len(hit):
                hist.append(float(losses[hit[0]]))
            elif run.present[sl].any():
                hist.append(NAN)
    mb = int(run.slot_micro_batches[slot])
    return StepView(run.run_id, step, idx, run.stage[idx].copy(), missing, cols, float(run.best_p2p[slot]),
                    max(1, run.dp), max(run.world_size, len(idx)), np.array(hist), int(run.slot_end_ns[slot]),
                    max(1, run.pp), mb if mb > 0 else run.micro_batches)


#: ranks a "judged on N of M ranks" note names before it says how many more
MISSING_SHOWN = 8


def judged_on_text(v: StepView) -> str:
    """'; judged on 6 of 8 ranks (missing: 3, 5)' for a step judged without every expected rank's
    STEP row (at the step deadline, or in a recompute), '' for a complete one: an alert raised or updated
    on it stands on part of the run, and a recompute over the rows that came later may differ."""
    if not v.missing:
        return ""
    n, miss = len(v.rank), v.missing
    shown = ", ".join(map(str, miss[:MISSING_SHOWN]))
    more = f", +{len(miss) - MISSING_SHOWN} more" if len(miss) > MISSING_SHOWN else ""
    return f"; judged on {n} of {n + len(miss)} ranks (missing: {shown}{more})"


@dataclass
class Figures:
    """Every per-step signal of one step (what the views give for that step)."""

    view: StepView
    compute_ms: np.ndarray
    wait_ms: np.ndarray
    straggler: sg.StragglerScores
    grad_sync_ms: np.ndarray
    grad_sync_p50_ms: float
    grad_sync_p99_ms: float
    step_ms_p50: float
    comm_share: float
    comm_share_rank: np.ndarray
    budgets: list[sg.BubbleBudget]
    imbalance: tuple[float, int, int]
    per_gpu_tokens_per_s: float
    within_efficiency: float
    memory_used: np.ndarray
    memory_budget: np.ndarray
    loss: float
    loss_spike: float = NAN
    loss_median: float = NAN
    lost: lost_mod.StepLost | None = None
    cost: lost_mod.CostSettings = field(default_factory=lost_mod.CostSettings)
    extra: dict = field(default_factory=dict)


def _ms(v: np.ndarray) -> np.ndarray:
    return v / 1e6


def step_figures(v: StepView, *, loss_window: int = 16, cost: lost_mod.CostSettings | None = None) -> Figures:
    c = v.cols
    compute_ms, wait_ms = _ms(c["compute_ns"]), _ms(c["coll_wait_ns"])
    grad = _ms(c["grad_sync_ns"])
    p50, p99 = sg.quantiles(grad)
    dur = _ms(c["duration_ns"])
    with np.errstate(divide="ignore", invalid="ignore"):
        share_rank = np.where(dur > 0, _ms(c["comm_exposed_ns"]) / dur, np.nan)
    budgets = []
    if (v.stage >= 0).any():
        budgets = sg.bubble_budget(v.stage, dur, _ms(c["forward_ns"] + c["backward_ns"]), _ms(c["p2p_ns"]),
                                   c["p2p_bytes"], v.best_p2p_bytes_per_ns * 1e6, _ms(c["reduce_ns"]),
                                   _ms(c["optimizer_ns"]))
    # the step's peak where the hooks give one (the pressure a budget is about: activations are
    # freed by the step's end, so an RSS sample there read 410 MiB of a step that peaked at 729),
    # else what is allocated, else the RSS
    used = np.where(c["peak_bytes"] > 0, c["peak_bytes"],
                    np.where(c["allocated_bytes"] > 0, c["allocated_bytes"], c["rss_bytes"]))
    losses = c["loss"][~np.isnan(c["loss"])]
    loss = float(losses[0]) if len(losses) else NAN
    spike, med = sg.loss_spike(v.loss_history, loss, loss_window)
    cost = cost or lost_mod.CostSettings()
    scores = sg.straggler_scores(v.stage, compute_ms, wait_ms)
    lost = lost_mod.step_lost(v.rank, dur, compute_ms, scores.others_compute_ms, _ms(c["data_wait_ns"]),
                              _ms(c["forward_ns"] + c["backward_ns"]), _ms(c["p2p_ns"]), c["p2p_bytes"],
                              v.best_p2p_bytes_per_ns * 1e6, _ms(c["comm_exposed_ns"]), pp=v.pp,
                              micro_batches=v.micro_batches, gpus=v.world, comm_baseline_share=cost.comm_baseline_share,
                              step=v.step, end_ns=v.end_ns)
    return Figures(
        view=v, compute_ms=compute_ms, wait_ms=wait_ms, straggler=scores,
        grad_sync_ms=grad, grad_sync_p50_ms=p50, grad_sync_p99_ms=p99, step_ms_p50=float(np.median(dur)),
        comm_share=sg.comm_share(_ms(c["comm_exposed_ns"]), dur), comm_share_rank=share_rank, budgets=budgets,
        imbalance=sg.stage_imbalance(budgets),
        per_gpu_tokens_per_s=sg.per_gpu_tokens_per_s(c["tokens"], dur, v.dp, v.world),
        within_efficiency=sg.within_run_efficiency(compute_ms, _ms(c["comm_exposed_ns"])),
        memory_used=used, memory_budget=c["budget_bytes"], loss=loss, loss_spike=spike, loss_median=med,
        lost=lost, cost=cost,
    )


@dataclass(frozen=True)
class Baseline:
    """A baseline run's figures (median over its steps), from the `run_scaling` view, or a rule's
    declared per-rank throughput."""

    run_id: str
    dp: int
    per_gpu_tokens_per_s: float
    grad_sync_p50_ms: float


@dataclass(frozen=True)
class Obs:
    """One scope instance of one rule at one step. `message` may hold `{steps}` (the hold count)."""

    scope: str
    labels: dict[str, str]
    value: float
    breached: bool
    message: str


def _straggler_cost(f: Figures, i: int) -> str:
    """'; it costs 2.6 GPU-h per hour (...)': the GPU time this rank's excess holds every GPU up
    per hour of training, at this step (lost.py's straggler cause)."""
    lost = f.lost
    if lost is None:
        return ""
    if lost.pacer != int(f.view.rank[i]):
        return f"; rank {lost.pacer} is slower still and sets the pace" if lost.pacer >= 0 else ""
    rate = lost_mod.cost_per_hour_text(float(lost.straggler_gpu_ms[i]), lost.step_ms, f.cost)
    return (f"; it costs {rate}: {lost.gpus} GPUs wait {lost.excess_ms[i]:.0f} ms of every "
            f"{lost.step_ms:.0f} ms step") if rate else ""


DATA_PACER_MS = 20.0


def _data_pacer(f: Figures) -> str:
    """'; the ranks wait on rank 2's data loading ...' where the rank that set the step's pace was
    late by its data wait more than by its compute (lost.py): the others' wait is not the network."""
    lost = f.lost
    if lost is None or lost.pacer < 0:
        return ""
    i = int(np.nonzero(f.view.rank == lost.pacer)[0][0])
    data_ms = float(lost.data_gpu_ms[i]) / max(1, lost.gpus)
    # its data wait made it late (more than compute did), and by a share of the step worth saying
    if lost.data_gpu_ms[i] <= lost.straggler_gpu_ms[i] or not data_ms >= max(DATA_PACER_MS, 0.1 * f.step_ms_p50):
        return ""
    return f"; the wait is rank {lost.pacer}'s data loading ({data_ms:.0f} ms a step), not the network"


def _rank_labels(rank: int, stage: int) -> dict[str, str]:
    out = {"rank": str(rank)}
    if stage >= 0:
        out["stage"] = str(stage)
    return out


def _worth(rule: Rule, vals: np.ndarray) -> np.ndarray:
    """Indices worth an observation: breached, or inside the hysteresis band (still firing there).
    Ranks back to normal need none: the alert book resolves what it does not see."""
    with np.errstate(invalid="ignore"):
        if rule.op == "above":
            lim = rule.clear if rule.clear is not None else rule.threshold
            m = (vals > rule.threshold) | (vals >= lim)
        else:
            lim = rule.clear if rule.clear is not None else rule.threshold
            m = (vals < rule.threshold) | (vals <= lim)
    return np.nonzero(m & ~np.isnan(vals))[0]


def observe(rule: Rule, f: Figures, baseline: Baseline | None = None) -> list[Obs]:
    """The rule's observations at this step (empty when the signal has nothing to say)."""
    v = f.view
    s = rule.signal
    out: list[Obs] = []
    if s == "straggler":
        sc = f.straggler
        flags = sg.stragglers(sc, f.wait_ms, excess_ms=rule.threshold, ratio=rule.params.get("compute_ratio_above", 1.5),
                              z=rule.params.get("z_above", 3.5))
        for i in np.nonzero(flags)[0]:
            r, st = int(v.rank[i]), int(v.stage[i])
            where = f"stage {st}" if st >= 0 else "the run"
            z = f" (z = {sc.z_compute[i]:.1f})" if sc.stage_ranks[i] >= sg.Z_MIN_RANKS else f" ({sc.compute_ratio[i]:.1f}x)"
            msg = (f"rank {r} computes {sc.excess_ms[i]:.0f} ms longer than the median of {where}'s other ranks "
                   f"({sc.others_compute_ms[i]:.0f} ms){z} for {{steps}} steps and waits {f.wait_ms[i]:.0f} ms in "
                   f"collectives where they wait {sc.others_wait_ms[i]:.0f} ms: it is the straggler"
                   f"{_straggler_cost(f, i)}")
            out.append(Obs("rank", _rank_labels(r, st), float(sc.excess_ms[i]), True, msg))
        return out
    if s == "data_stall":
        data_ms = _ms(v.cols["data_wait_ns"].clip(min=0))
        sc = sg.straggler_scores(v.stage, data_ms, f.wait_ms)
        flags = sg.stragglers(sc, f.wait_ms, excess_ms=rule.threshold, ratio=rule.params.get("data_ratio_above", 2.0),
                              z=rule.params.get("z_above", 3.5))
        for i in np.nonzero(flags)[0]:
            r, st = int(v.rank[i]), int(v.stage[i])
            where = f"stage {st}" if st >= 0 else "the run"
            msg = (f"rank {r} waits {data_ms[i]:.0f} ms a step for its data loader, {sc.excess_ms[i]:.0f} ms more than "
                   f"the median of {where}'s other ranks ({sc.others_compute_ms[i]:.0f} ms) for {{steps}} steps, while "
                   f"they wait {sc.others_wait_ms[i]:.0f} ms in collectives for it (it waits {f.wait_ms[i]:.0f} ms): "
                   f"a data-loader straggler; the cause is data, not the network")
            out.append(Obs("rank", {**_rank_labels(r, st), "cause": "data"}, float(sc.excess_ms[i]), True, msg))
        return out
    if s == "grad_sync":
        val = f.grad_sync_p99_ms
        msg = (f"grad-sync p99 across ranks {val:.0f} ms (p50 {f.grad_sync_p50_ms:.0f} ms) at step {v.step}, "
               f"above {rule.threshold:g} ms for {{steps}} steps (DP gradient reductions of {sg.GRAD_MIN_BYTES}+ bytes)"
               f"{_data_pacer(f)}")
        return [Obs("run", {}, val, rule.breached(val), msg)]
    if s == "comm_share":
        if rule.scope == "rank":
            for i in _worth(rule, f.comm_share_rank):
                val = float(f.comm_share_rank[i])
                msg = (f"rank {int(v.rank[i])} spends {val:.0%} of its step in exposed communication "
                       f"(above {rule.threshold:.0%}) for {{steps}} steps")
                out.append(Obs("rank", _rank_labels(int(v.rank[i]), int(v.stage[i])), val, rule.breached(val), msg))
            return out
        val = f.comm_share
        msg = (f"exposed communication is {val:.0%} of step time (above {rule.threshold:.0%}) for {{steps}} steps"
               f"{_data_pacer(f)}")
        return [Obs("run", {}, val, rule.breached(val), msg)]
    if s == "bubble":
        imb, slow, fast = f.imbalance
        limit = rule.params.get("imbalance_above", 1.2)
        for b in f.budgets:
            val = b.waiting
            named = ""
            labels = {"stage": str(b.stage)}
            if imb == imb and imb > limit:
                named = f"; stage {slow} is the slow stage (computes {imb:.1f}x stage {fast})"
                labels["slow_stage"] = str(slow)
            msg = (f"stage {b.stage} waits on its neighbour stage {val:.0%} of its step time (above "
                   f"{rule.threshold:.0%}) for {{steps}} steps{named}; budget: compute {b.compute:.0%}, waiting "
                   f"{b.waiting:.0%}, p2p transfer {b.transfer:.0%}, reduce/optimizer tail {b.tail:.0%}, framework "
                   f"overhead {b.overhead:.0%} (bubble {b.bubble:.2f})")
            out.append(Obs("stage", labels, val, rule.breached(val), msg))
        return out
    if s == "stage_imbalance":
        imb, slow, fast = f.imbalance
        if imb != imb:
            return []
        msg = f"stage {slow} computes {imb:.2f}x as long as stage {fast} (above {rule.threshold:g}) for {{steps}} steps"
        return [Obs("run", {"slow_stage": str(slow)}, imb, rule.breached(imb), msg)]
    if s == "scaling_efficiency":
        declared = rule.params.get("per_rank_tokens_per_s")
        base = declared if declared else (baseline.per_gpu_tokens_per_s if baseline else NAN)
        if not base == base or base <= 0:
            return []
        val = f.per_gpu_tokens_per_s / base
        against = f"the declared {declared:g} tokens/s per rank" if declared else (
            f"baseline run {baseline.run_id} (DP{baseline.dp}, {base:.0f} tokens/s per rank)")  # type: ignore[union-attr]
        msg = (f"scaling efficiency {val:.2f} against {against}: {f.per_gpu_tokens_per_s:.0f} tokens/s per rank at "
               f"DP{v.dp}, below {rule.threshold:g} for {{steps}} steps (within the run: compute / (compute + exposed "
               f"comm) = {f.within_efficiency:.2f})")
        labels = {"baseline": baseline.run_id} if baseline and not declared else {}
        return [Obs("run", labels, val, rule.breached(val), msg)]
    if s == "grad_sync_scaling":
        if baseline is None:
            return []
        floor = rule.params.get("baseline_floor_ms", 1.0)
        val = sg.sqrt_k_ratio(f.grad_sync_p50_ms, v.dp, baseline.grad_sync_p50_ms, baseline.dp, floor)
        if val != val:
            return []
        k = v.dp / baseline.dp
        base = max(baseline.grad_sync_p50_ms if baseline.grad_sync_p50_ms == baseline.grad_sync_p50_ms else 0.0, floor)
        msg = (f"grad-sync p50 {f.grad_sync_p50_ms:.0f} ms at DP{v.dp} is {val:.2f}x sqrt(k) x baseline run "
               f"{baseline.run_id}'s {base:.1f} ms (k = {k:g}, DP{baseline.dp}); the rule wants below sqrt({k:g}) x, "
               f"for {{steps}} steps")
        return [Obs("run", {"baseline": baseline.run_id}, val, rule.breached(val), msg)]
    if s == "memory":
        declared = rule.params.get("budget_mb")
        budget = np.where(f.memory_budget > 0, f.memory_budget, declared * 2**20 if declared else np.nan)
        frac = sg.memory_used_of_budget(f.memory_used, budget)
        for i in _worth(rule, frac):
            val = float(frac[i])
            peak = " at its step's peak" if v.cols["peak_bytes"][i] > 0 else ""
            msg = (f"rank {int(v.rank[i])} uses {f.memory_used[i] / 2**20:.0f} MiB of its {budget[i] / 2**20:.0f} MiB "
                   f"budget{peak} ({val:.0%}, above {rule.threshold:.0%}) at step {v.step}")
            out.append(Obs("rank", _rank_labels(int(v.rank[i]), int(v.stage[i])), val, rule.breached(val), msg))
        return out
    if s == "offload_bandwidth":
        c = v.cols
        for d in ("d2h", "h2d"):
            with np.errstate(divide="ignore", invalid="ignore"):
                rates = np.where(c[d + "_ns"] > 0, c[d + "_bytes"] / c[d + "_ns"], np.nan)
            for i in _worth(rule, rates):
                val = float(rates[i])
                msg = (f"rank {int(v.rank[i])} offloads {d} at {val:.2f} GB/s over its copy time (below "
                       f"{rule.threshold:g} GB/s) for {{steps}} steps")
                out.append(Obs("rank", {**_rank_labels(int(v.rank[i]), int(v.stage[i])), "direction": d}, val,
                               rule.breached(val), msg))
        return out
    if s == "loss_spike":
        window = int(rule.params.get("window_steps", 16))
        spike, med = sg.loss_spike(v.loss_history, f.loss, window)
        if spike != spike:
            return []
        msg = (f"loss {f.loss:.4f} at step {v.step} is {spike:.0%} over its rolling median {med:.4f} of the "
               f"{window} steps before (above {rule.threshold:.0%})")
        return [Obs("run", {}, spike, rule.breached(spike), msg)]
    if s == "throughput_per_gpu":
        c = v.cols
        dur = c["duration_ns"] / 1e9
        with np.errstate(divide="ignore", invalid="ignore"):
            tps = np.where((c["tokens"] >= 0) & (dur > 0), c["tokens"] / dur * v.dp / v.world, np.nan)
        for i in _worth(rule, tps):
            val = float(tps[i])
            msg = f"rank {int(v.rank[i])} trains {val:.0f} tokens/s, below the SLA {rule.threshold:g} for {{steps}} steps"
            out.append(Obs("rank", _rank_labels(int(v.rank[i]), int(v.stage[i])), val, rule.breached(val), msg))
        return out
    return out
