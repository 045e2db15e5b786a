"""What did it cost? GPU time lost per step, split by cause, summed into GPU-hours (and money where
a price per GPU-hour is declared). Pure functions over one step's per-rank figures; no I/O.

The `lost_time` view (collector/query/lost_sql.py, schema 8) gives the same numbers over stored rows and
tests hold the two equal. One step, every figure in ms, per rank r:

- **late** (what the step waits for): synchronous training waits for the slowest rank, so a rank
  that computes longer than its stage's other ranks, or waits for its data, holds every GPU up.
  excess_r = max(0, compute_r - the median compute of r's stage's *other* ranks) (the straggler
  signal's reference: with one straggler among 3+ ranks it is the stage's median; with 2 ranks a
  stage it is the peer's compute), late_r = excess_r + data_wait_r. The step is L = max_r late_r
  later than had every rank computed at its stage's median with its data ready: the **what-if**
  step time is median(step_ms) - L. The rank with the largest late_r (the lowest on ties) is the
  *pacer*; its excess is charged as **straggler** time and its data wait as **data** time, each
  x the run's GPUs (every GPU waited): straggler_gpu_ms = excess_pacer x gpus, data_gpu_ms =
  data_wait_pacer x gpus, both on the pacer's row (the rank named).
- **victim wait**: each other rank waited L - late_r for the pacer, somewhere in its exposed
  communication (a DP collective, or a pipeline receive); that time is already counted above, so
  it is taken out of what follows, first out of the pipeline excess, then out of the communication.
- **pipeline**: p2p waiting (p2p time beyond the transfer at the step's best p2p rate, as in the
  bubble budget) above what a balanced 1F1B schedule idles for this rank's compute: with p stages
  and m micro-batches a stage idles (p-1)/m of its forward+backward time (the bubble
  (p-1)/(m+p-1) of the schedule's wall time). pipeline_gpu_ms_r = max(0, waiting_r - fwd_bwd_r x
  (p-1)/m - victim_r), on rank r.
- **comm**: exposed communication that is not p2p (comm_exposed - p2p) above a stated baseline
  share of the what-if step time (`comm_baseline_share`, default 0.30, the comm-share rule's
  line), less what is left of the victim wait: comm_gpu_ms_r, on rank r.
- **telemetry**: the rows carry no measure of the hooks' own time, so it is not split out (it sits
  inside compute and untracked time, counted as useful); `tracetop bench hooks` measures it.

lost_gpu_ms_r = straggler + data + pipeline + comm; the step's GPU-ms lost = the sum over ranks.
GPU-hours = GPU-ms / 3.6e6 (one GPU per rank); money = GPU-hours x the declared price.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tracetop.errors import TracetopError

CAUSES = ("straggler", "data", "pipeline", "comm")
DEFAULT_COMM_BASELINE_SHARE = 0.30
DEFAULT_WINDOW_S = 600.0
MS_PER_HOUR = 3.6e6
NAN = math.nan


@dataclass(frozen=True)
class CostSettings:
    """The [cost] table of the rules file (collector/live/rules.py), or the flags."""

    price_per_gpu_hour: float = NAN       # NaN: no price declared, no money shown
    currency: str = "USD"
    comm_baseline_share: float = DEFAULT_COMM_BASELINE_SHARE
    window_s: float = DEFAULT_WINDOW_S    # "the last N minutes" of the gauges and the TUI line

    @property
    def priced(self) -> bool:
        return self.price_per_gpu_hour == self.price_per_gpu_hour

    def money(self, gpu_hours: float) -> float:
        return gpu_hours * self.price_per_gpu_hour if self.priced else NAN

    def money_text(self, gpu_hours: float) -> str:
        return f"{self.money(gpu_hours):,.2f} {self.currency}" if self.priced else ""


@dataclass(frozen=True)
class StepLost:
    """One step's lost GPU time, per rank (arrays in the input's order), in GPU-ms."""

    step: int
    end_ns: int
    gpus: int
    step_ms: float            # median step time over the ranks
    late_ms: float            # L: how much later the step ended than the what-if
    what_if_step_ms: float
    pacer: int                # the rank the step waited for (-1: nobody late)
    rank: np.ndarray
    excess_ms: np.ndarray
    straggler_gpu_ms: np.ndarray
    data_gpu_ms: np.ndarray
    pipeline_gpu_ms: np.ndarray
    comm_gpu_ms: np.ndarray

    @property
    def lost_gpu_ms(self) -> np.ndarray:
        return self.straggler_gpu_ms + self.data_gpu_ms + self.pipeline_gpu_ms + self.comm_gpu_ms

    def by_cause(self) -> dict[str, float]:
        return {c: float(getattr(self, c + "_gpu_ms").sum()) for c in CAUSES}

    @property
    def total_gpu_ms(self) -> float:
        return float(self.lost_gpu_ms.sum())


def step_lost(rank: np.ndarray, step_ms: np.ndarray, compute_ms: np.ndarray, others_compute_ms: np.ndarray,
              data_wait_ms: np.ndarray, fwd_bwd_ms: np.ndarray, p2p_ms: np.ndarray, p2p_bytes: np.ndarray,
              best_p2p_bytes_per_ms: float, comm_exposed_ms: np.ndarray, *, pp: int, micro_batches: int, gpus: int,
              comm_baseline_share: float = DEFAULT_COMM_BASELINE_SHARE, step: int = -1,
              end_ns: int = 0) -> StepLost:
    """The module docstring's definition for one step. `others_compute_ms`: the median compute of
    each rank's stage's other ranks (signals.straggler_scores; NaN for a rank alone in its stage)."""
    n = len(rank)
    gpus = max(int(gpus), n)
    with np.errstate(invalid="ignore"):
        excess = np.maximum(np.where(np.isnan(others_compute_ms), 0.0, compute_ms - others_compute_ms), 0.0)
    data_wait_ms = np.maximum(data_wait_ms, 0.0)  # -1 = unknown: no wait known
    late = excess + data_wait_ms
    if n:
        i = int(np.argmax(late))
        big_l = float(late[i])
        pacer = int(rank[i])
        med = float(np.median(step_ms))
    else:
        i, big_l, pacer, med = -1, 0.0, -1, NAN
    strag = np.zeros(n)
    data = np.zeros(n)
    if n and big_l > 0:
        strag[i] = float(excess[i]) * gpus
        data[i] = float(data_wait_ms[i]) * gpus
    else:
        pacer = -1
    victim = big_l - late
    rate = best_p2p_bytes_per_ms if best_p2p_bytes_per_ms > 0 else math.inf
    transfer = np.minimum(p2p_bytes / rate, p2p_ms)
    waiting = p2p_ms - transfer
    ideal = fwd_bwd_ms * ((pp - 1) / micro_batches) if pp > 1 and micro_batches > 0 else np.zeros(n)
    pipe_excess = np.maximum(waiting - ideal, 0.0)
    pipe = np.maximum(pipe_excess - victim, 0.0)
    victim_left = np.maximum(victim - pipe_excess, 0.0)
    what_if = max(med - big_l, 0.0) if n else NAN
    coll = np.maximum(comm_exposed_ms - p2p_ms, 0.0)
    comm = np.maximum(np.maximum(coll - comm_baseline_share * what_if, 0.0) - victim_left, 0.0)
    return StepLost(step, int(end_ns), gpus, med, big_l, what_if, pacer, np.asarray(rank), excess, strag, data,
                    pipe, comm)


class CostError(TracetopError, ValueError):
    """A price or currency that cannot be used; str() names the value and the fix."""


def with_price(cost: CostSettings, flag: float | None, env_text: str | None, currency: str | None = None,
               what: str = "--price-per-gpu-hour") -> CostSettings:
    """The configuration order: the flag, then TRACETOP_PRICE_PER_GPU_HOUR, then the rules file's
    [cost] price (already in `cost`). Raises CostError for a value that is not a positive number."""
    import dataclasses
    import re

    price: float | None = None
    if flag is not None:
        price, source = flag, what
    elif env_text is not None:
        source = "TRACETOP_PRICE_PER_GPU_HOUR"
        try:
            price = float(env_text)
        except ValueError:
            raise CostError(f"{source}={env_text!r} is not a number; set it to the price of one GPU-hour, "
                            "e.g. 2.50, or unset it") from None
    if price is not None:
        if not math.isfinite(price) or price <= 0:
            raise CostError(f"{source} {price!r}: a price per GPU-hour must be a positive number, e.g. 2.50")
        cost = dataclasses.replace(cost, price_per_gpu_hour=float(price))
    if currency is not None:
        if not re.fullmatch(r"[A-Za-z$\u20ac\u00a3\u00a5]{1,8}", currency):
            raise CostError(f"--currency {currency!r}: give a short currency name like USD or EUR (1-8 letters)")
        cost = dataclasses.replace(cost, currency=currency)
    return cost


# ------------------------------------------------------------------ summing steps (live gauges)
#: Ranks per step the recent window remembers (the most charged): bounds its memory and the cost of
#: each step at any rank count. With more ranks than this charged in a step, the window's top-rank
#: share is a lower bound (the whole-run sums keep every rank).
WINDOW_TOP_RANKS = 16


@dataclass
class RunLost:
    """A run's lost time as the live engine saw it: whole-run sums per cause and per rank, and a
    window of the last `window_s` seconds of step time (by the steps' own end times) kept as
    running sums, so adding a step costs O(ranks) and reading the window O(its ranks)."""

    window_s: float = DEFAULT_WINDOW_S
    max_window_steps: int = 200_000           # bounds the window's memory whatever the step rate
    gpu_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    held_gpu_ms: float = 0.0                  # GPUs x step time: what the run used, lost or not
    by_rank: np.ndarray = field(default_factory=lambda: np.zeros(0))  # GPU-ms charged to each rank (all causes)
    steps: int = 0
    newest_end_ns: int = 0
    # per step in the window: (end_ns, step_ms, cause sums, its most-charged ranks, their GPU-ms)
    recent: collections.deque = field(default_factory=collections.deque)
    _w_causes: np.ndarray = field(default_factory=lambda: np.zeros(len(CAUSES)))
    _w_wall_ms: float = 0.0
    _w_rank: dict[int, float] = field(default_factory=dict)

    def add(self, s: StepLost) -> None:
        causes = np.array([float(getattr(s, c + "_gpu_ms").sum()) for c in CAUSES])
        for c, v in zip(CAUSES, causes, strict=True):
            self.gpu_ms[c] += float(v)
        step_ms = s.step_ms if s.step_ms == s.step_ms else 0.0
        self.held_gpu_ms += step_ms * s.gpus
        lost = s.lost_gpu_ms
        if len(s.rank):
            top = int(np.max(s.rank)) + 1
            if top > len(self.by_rank):
                grow = max(top, 2 * len(self.by_rank)) - len(self.by_rank)
                self.by_rank = np.concatenate([self.by_rank, np.zeros(grow)])
            self.by_rank[s.rank] += lost
        k = min(WINDOW_TOP_RANKS, len(lost))
        idx = np.argpartition(-lost, k - 1)[:k] if 0 < k < len(lost) else np.arange(len(lost))
        idx = idx[lost[idx] > 0]
        ranks, vals = np.asarray(s.rank)[idx].astype(np.int64), lost[idx]
        self.steps += 1
        self.newest_end_ns = max(self.newest_end_ns, s.end_ns)
        self.recent.append((s.end_ns, step_ms, causes, ranks, vals))
        self._w_causes += causes
        self._w_wall_ms += step_ms
        for r, v in zip(ranks.tolist(), vals.tolist(), strict=True):
            self._w_rank[r] = self._w_rank.get(r, 0.0) + v
        lo = self.newest_end_ns - int(self.window_s * 1e9)
        while self.recent and (self.recent[0][0] < lo or len(self.recent) > self.max_window_steps):
            _, ms, c, rr, vv = self.recent.popleft()
            self._w_causes -= c
            self._w_wall_ms -= ms
            for r, v in zip(rr.tolist(), vv.tolist(), strict=True):
                left = self._w_rank[r] - v
                if left <= 1e-9 * max(1.0, v):
                    del self._w_rank[r]
                else:
                    self._w_rank[r] = left
        if not self.recent:
            self._w_causes[:] = 0.0
            self._w_wall_ms = 0.0
            self._w_rank.clear()

    def window(self) -> tuple[dict[str, float], float, dict[int, float], float]:
        """({cause: GPU-ms}, summed step ms, {rank: GPU-ms charged, of its most-charged ranks per
        step}, seconds between the window's first and last step ends)."""
        span = (self.newest_end_ns - self.recent[0][0]) / 1e9 if self.recent else 0.0
        causes = {c: max(0.0, float(v)) for c, v in zip(CAUSES, self._w_causes, strict=True)}
        return causes, max(0.0, self._w_wall_ms), dict(self._w_rank), span

    def top_rank(self) -> tuple[int, float]:
        """(the rank most of the whole run's lost time is charged to, its share)."""
        total = sum(self.gpu_ms.values())
        if not len(self.by_rank) or total <= 0:
            return -1, NAN
        r = int(np.argmax(self.by_rank))
        return (r, float(self.by_rank[r]) / total) if self.by_rank[r] > 0 else (-1, NAN)


def top_rank(by_rank: Mapping[int, float], total_gpu_ms: float) -> tuple[int, float]:
    """(the rank most lost is charged to, its share of the total); (-1, NaN) when nothing was lost."""
    if not by_rank or total_gpu_ms <= 0:
        return -1, NAN
    r = max(sorted(by_rank), key=lambda k: by_rank[k])
    return r, by_rank[r] / total_gpu_ms


def gpu_hours(gpu_ms: float) -> float:
    return gpu_ms / MS_PER_HOUR


def cost_per_hour_text(gpu_ms_per_step: float, step_ms: float, cost: CostSettings) -> str:
    """'3.2 GPU-h per hour (8.00 USD/h)': a step-rate figure as what it costs per hour of training."""
    if not step_ms or step_ms != step_ms or step_ms <= 0:
        return ""
    rate = gpu_ms_per_step / step_ms  # GPU-ms lost per ms of wall time = GPU-h per hour
    money = f" ({cost.money(rate):,.2f} {cost.currency}/h at {cost.price_per_gpu_hour:g} per GPU-h)" if cost.priced else ""
    return f"{rate:.2f} GPU-h per hour{money}"
