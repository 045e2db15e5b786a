"""Live state: per run, the last W steps of per-rank figures, the latest heartbeat of each rank,
the agents' latest GPU samples. Fed with committed batches (decoded columns), vectorised.

Memory is fixed by W and the ranks: one float64 matrix `data[W, FIELDS, ranks]` (28 figures a
rank-step: 16,384 ranks x 64 steps = 235 MB) plus a presence mask and a collective-signature
bitmask. A row for a step older than the window is dropped (counted in `rows_too_old`); a newer
step reuses the oldest slot, and the steps it pushes out unevaluated are counted as skipped by
the engine. Nothing here queues.

One thread touches it (the engine's); ingest and evaluation take turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from collector.live.signals import GRAD_MIN_BYTES, GRAD_OPS
from tracetop.events import Kind

FIELDS = (
    "duration_ns", "compute_ns", "comm_exposed_ns", "forward_ns", "backward_ns", "optimizer_ns", "data_wait_ns",
    "tokens", "samples", "loss",                       # STEP
    "coll_wait_ns", "grad_sync_ns", "p2p_ns", "p2p_bytes",  # COLLECTIVE
    "reduce_ns",                                        # PIPE_INSTR ReduceGrads + ReduceTiedGrads
    "rss_bytes", "allocated_bytes", "budget_bytes",     # MEMORY
    "d2h_bytes", "d2h_ns", "h2d_bytes", "h2d_ns",       # OFFLOAD
    "mfu",                                              # THROUGHPUT
    # for Query.Watch's snapshots (collector/query/watch.py), with collector/query/snapshot.py's SQL definitions:
    "tokens_per_s",                                     # THROUGHPUT (NaN: no row)
    "dp_coll_ns",                                       # COLLECTIVE whose role names dp (LIKE '%dp%')
    "micro_batch", "micro_batches",                     # STEP: the shape in force (the controller's inputs)
    "peak_bytes",                                       # MEMORY: the step's peak
)
F = {name: i for i, name in enumerate(FIELDS)}
_STEP_COLS = FIELDS[:10]
_REDUCE_INSTR = ("ReduceGrads", "ReduceTiedGrads")
MAX_SIGS = 63  # distinct (op, role) pairs a run may have in its signature bitmask
#: The largest world size taken from a RUN_START row (larger claims are capped): with the window
#: arrays sized by the ranks actually heard, one run's state stays under W x 14 KiB x this.
MAX_WORLD = 1 << 15
#: Ranks a run may grow to before any RUN_START row said its world size (the hooks send it before
#: their first STEP row; an early heartbeat of a higher rank is refused, counted, and the next taken).
PROVISIONAL_RANKS = 4096


def _strings(col) -> np.ndarray:
    """A decoded string column as an object array."""
    codes, dictionary = col
    return np.asarray(dictionary, dtype=object)[codes] if len(dictionary) else np.full(len(codes), "", object)


@dataclass
class RunState:
    run_id: str
    window: int
    ranks: int = 0
    world_size: int = 0
    dp: int = 1
    pp: int = 1
    tp: int = 1
    micro_batches: int = -1
    flops_per_token: float = float("nan")
    stage: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    hostname: np.ndarray = field(default_factory=lambda: np.zeros(0, object))  # per rank, from RUN_START
    started: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))      # a RUN_START row came in
    first_step: int = -1                # the oldest step any row was taken for (-1: none yet)
    data: np.ndarray = field(default_factory=lambda: np.zeros((0, len(FIELDS), 0)))
    present: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), bool))
    sigmask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    slot_step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    slot_first_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    slot_last_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # latest row into the slot
    #: per slot: the collector's clock when its first STEP row came in (0: none yet). The step
    #: deadline counts from here, not from the slot's first row of any kind: the collectives a rank
    #: ships while its step is still running (every flush) must not start a long step's deadline
    slot_step_first_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    best_p2p: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per slot: max bytes/ns of a p2p call
    slot_end_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per slot: latest STEP end (ranks' clock)
    slot_micro_batches: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per slot: STEP micro_batches
    sigs: dict[tuple[str, str], int] = field(default_factory=dict)
    # heartbeats: latest per rank
    hb_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    hb_first_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # a rank's first heartbeat (0: none)
    hb_step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    hb_since: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    hb_op: np.ndarray = field(default_factory=lambda: np.zeros(0, object))
    hb_role: np.ndarray = field(default_factory=lambda: np.zeros(0, object))
    hb_phase: np.ndarray = field(default_factory=lambda: np.zeros(0, object))
    #: of a rank's latest heartbeat in a collective: how long it had been in it (ns) and at which step
    #: (a rank seen stuck in one that is now in none came out of it: a timeout, an error)
    hb_held_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    hb_held_step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # heard: per rank, the latest time (its own clock) and step of any row, and the step of its
    # latest row (where it is now, for re-anchoring the window after an outlier step)
    seen_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seen_step: np.ndarray = field(default_factory=lambda: np.full(0, -1, np.int64))
    rank_last: np.ndarray = field(default_factory=lambda: np.full(0, -1, np.int64))
    heard_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the collector's clock
    rank_seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # ingest_seq of its latest row
    ingest_seq: int = 0                 # batches ingested into this run
    newest_seq: int = 0                 # the batch that last moved newest_step forward
    first_ns: int = 0                   # the earliest row of the run (ranks' clocks, or see receive_clock; 0: none yet)
    newest_step: int = -1
    last_evaluated: int = -1
    last_judged: int = -1               # the newest step actually judged (last_evaluated also moves past skips)
    steps_incomplete: int = 0           # steps judged without every expected rank's STEP row (the engine counts)
    steps_skipped: int = 0              # this run's steps pushed out of the window unjudged (the engine counts)
    last_incomplete_step: int = -1      # the latest of them (-1: none)
    #: heartbeat and "heard" times (hb_ns, hb_since, seen_ns, first_ns) on the collector's clock:
    #: each rank's newest row of a delivery is taken as received at ``now_ns``, its other rows
    #: placed before it by their distance on the rank's own clock (differences on one clock are
    #: skew-free). A rank whose clock runs 40 s ahead or behind, or is stepped back, then looks
    #: neither silent nor alive for longer than it is (its shipping delay, at most a flush
    #: interval, is the error: late, never early). Set by the collector (collector/app.py); off,
    #: the ranks' own clocks are used as they are (replaying a file, where "now" is their clock).
    receive_clock: bool = False
    ended: bool = False                 # every rank silent for the engine's run_end_s
    ended_at_ns: int = 0
    rows_too_old: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # rows refused, by reason
    reanchored: int = 0                 # times the window moved back to where the ranks are (an outlier step)
    skipped_recent: int = 0             # steps the engine counted as skipped since newest_step last advanced
    skip_refund: int = 0                # of those, the ones a re-anchor showed were never steps (the engine takes them back)
    last_row_ns: int = 0
    grow_room: object = None            # LiveState's budget: () -> the bytes it has left (None: no bound)
    # the engine's notes: the first rank a hang rule named, the first failure once named
    hang_named: int = -1
    first_failure: object = None

    def __post_init__(self) -> None:
        w = self.window
        self.data = np.zeros((w, len(FIELDS), 0))
        self.present = np.zeros((w, 0), bool)
        self.sigmask = np.zeros((w, 0), np.int64)
        self.slot_step = np.full(w, -1, np.int64)
        self.slot_first_ns = np.zeros(w, np.int64)
        self.slot_last_ns = np.zeros(w, np.int64)
        self.slot_step_first_ns = np.zeros(w, np.int64)
        self.best_p2p = np.zeros(w)
        self.slot_end_ns = np.zeros(w, np.int64)
        self.slot_micro_batches = np.full(w, -1, np.int64)

    # -- sizing ---------------------------------------------------------------------------
    def rank_limit(self) -> int:
        """Ranks this run may hold: its world size once a RUN_START said it, else PROVISIONAL_RANKS."""
        return self.world_size if self.world_size > 0 else PROVISIONAL_RANKS

    def refuse(self, reason: str, n: int) -> None:
        if n:
            self.refused[reason] = self.refused.get(reason, 0) + int(n)

    def bytes_per_rank(self) -> int:
        return self.window * (len(FIELDS) * 8 + 1 + 8) + 8 * 12 + 5 * 8

    def ensure_ranks(self, n: int) -> bool:
        """Grow the per-rank arrays to hold ranks < n (doubling, within rank_limit and the live
        state's budget); False when they cannot. Where the budget holds fewer, they grow to as many
        as it holds (the ranks past them are refused by the caller, counted): a world too large for
        the budget is judged in part, not at all."""
        if n <= self.ranks:
            return True
        limit = self.rank_limit()
        if n > limit:
            return False
        want = n
        n = min(limit, max(n, self.ranks * 2 if self.ranks else n))
        if callable(self.grow_room):
            n = min(n, self.ranks + max(0, int(self.grow_room())) // self.bytes_per_rank())
            if n <= self.ranks:
                return False
        extra = n - self.ranks
        more = np.zeros((self.window, len(FIELDS), extra))
        more[:, F["tokens_per_s"]] = np.nan
        self.data = np.concatenate([self.data, more], axis=2)
        self.hostname = np.concatenate([self.hostname, np.full(extra, "", object)])
        self.started = np.concatenate([self.started, np.zeros(extra, bool)])
        self.present = np.concatenate([self.present, np.zeros((self.window, extra), bool)], axis=1)
        self.sigmask = np.concatenate([self.sigmask, np.zeros((self.window, extra), np.int64)], axis=1)
        self.stage = np.concatenate([self.stage, np.full(extra, -1, np.int32)])
        self.hb_ns = np.concatenate([self.hb_ns, np.zeros(extra, np.int64)])
        self.hb_first_ns = np.concatenate([self.hb_first_ns, np.zeros(extra, np.int64)])
        self.hb_step = np.concatenate([self.hb_step, np.full(extra, -1, np.int64)])
        self.hb_since = np.concatenate([self.hb_since, np.full(extra, -1, np.int64)])
        self.hb_held_ns = np.concatenate([self.hb_held_ns, np.zeros(extra, np.int64)])
        self.hb_held_step = np.concatenate([self.hb_held_step, np.full(extra, -1, np.int64)])
        for name in ("hb_op", "hb_role", "hb_phase"):
            setattr(self, name, np.concatenate([getattr(self, name), np.full(extra, "", object)]))
        self.seen_ns = np.concatenate([self.seen_ns, np.zeros(extra, np.int64)])
        self.heard_at = np.concatenate([self.heard_at, np.zeros(extra, np.int64)])
        self.seen_step = np.concatenate([self.seen_step, np.full(extra, -1, np.int64)])
        self.rank_last = np.concatenate([self.rank_last, np.full(extra, -1, np.int64)])
        self.rank_seq = np.concatenate([self.rank_seq, np.zeros(extra, np.int64)])
        self.ranks = n
        return n >= want

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.data, self.present, self.sigmask, self.stage, self.hostname, self.started, self.hb_ns, self.hb_first_ns, self.hb_step,
                                      self.hb_since, self.hb_op, self.hb_role, self.hb_phase, self.hb_held_ns,
                                      self.hb_held_step, self.seen_ns, self.heard_at,
                                      self.seen_step, self.rank_last))

    def expected_ranks(self) -> int:
        return self.world_size if self.world_size > 0 else self.ranks

    # -- slots ----------------------------------------------------------------------------
    def _slots_for(self, steps: np.ndarray, now_ns: int, rank: np.ndarray | None = None) -> np.ndarray:
        """Slot index per row, or -1 for rows of steps outside the window (too old / negative /
        beyond where the ranks are, after a re-anchor). Vectorised: the window's W consecutive steps
        map to W distinct slots, so a row's slot (step % W) names its step; a slot holding an older
        step is reset for the new one."""
        if not len(steps):
            return np.full(0, -1, np.int64)
        top = int(steps.max())
        if top > self.newest_step:
            self.newest_step, self.newest_seq = top, self.ingest_seq
            self.skipped_recent = 0
            # the rank that sent it sent later rows (lower steps) in this same batch: it moved on
            # already, so this batch's rows count as sent since (one shipment holding the outlier)
            at = int(np.nonzero(steps == top)[0][-1])
            if rank is not None and rank[at] >= 0 and (rank[at + 1:] == rank[at]).any():
                self.newest_seq = self.ingest_seq - 1
        self._reanchor()
        w = self.window
        valid = (steps >= 0) & (steps > self.newest_step - w) & (steps <= self.newest_step)
        self.refuse("step_outlier", int((steps > self.newest_step).sum()))
        slots = np.where(valid, steps % w, -1)
        if not valid.any():
            return slots
        oldest = int(steps[valid].min())
        if self.first_step < 0 or oldest < self.first_step:
            self.first_step = oldest
        us, first = np.unique(slots[valid], return_index=True)
        ustep = steps[valid][first]
        fresh = self.slot_step[us] != ustep
        if fresh.any():
            r = us[fresh]
            self.data[r] = 0.0
            self.data[r, F["loss"]] = np.nan
            self.data[r, F["tokens_per_s"]] = np.nan
            self.present[r] = False
            self.sigmask[r] = 0
            self.best_p2p[r] = 0.0
            self.slot_end_ns[r] = 0
            self.slot_micro_batches[r] = -1
            self.slot_step[r] = ustep[fresh]
            self.slot_first_ns[r] = now_ns
            self.slot_step_first_ns[r] = 0
        self.slot_last_ns[us] = now_ns
        return slots

    #: ranks last heard longer ago than this (the collector's clock) do not say where the run is
    REANCHOR_HEARD_S = 60.0

    def _reanchor(self) -> None:
        """One outlier step number (10**12) must not blind the run: when more than half of the
        ranks heard lately have sent rows since the newest step was set, and every one of those
        ranks' latest rows is outside the window (none followed it there), the window moves back
        to where they are. Ranks shipping in turn (one rank's shipment moves the window, the
        others' next ones follow it) and a laggard's backlog never do this. An honest move back
        (every rank resumed from an older checkpoint) re-anchors the same way."""
        if self.newest_step < 0 or not self.ranks:
            return
        recent = (self.rank_last >= 0) & (self.heard_at >= self.heard_at.max() - int(self.REANCHOR_HEARD_S * 1e9))
        lo = self.newest_step - self.window + 1
        since = recent & (self.rank_seq > self.newest_seq)
        stale = since & ((self.rank_last < lo) | (self.rank_last > self.newest_step))
        if 2 * int(stale.sum()) <= int(recent.sum()) or (since & ~stale).any():
            return
        at = self.rank_last[stale]
        target = int(at[at <= np.median(at) + self.window].max())
        if target >= self.newest_step:
            return
        gone = self.slot_step > target
        self.slot_step[gone] = -1
        self.present[gone] = False
        self.newest_step, self.newest_seq = target, self.ingest_seq
        self.skip_refund += self.skipped_recent
        self.skipped_recent = 0
        self.last_evaluated = min(self.last_evaluated, max(self.last_judged, target - self.window))
        self.reanchored += 1

    def slot_of(self, step: int) -> int:
        slot = step % self.window
        return slot if int(self.slot_step[slot]) == step else -1

    # -- ingest ---------------------------------------------------------------------------
    def ingest(self, kind: Kind, cols: dict, now_ns: int) -> None:
        n = len(cols["rank"])
        if n == 0:
            return
        rank = np.asarray(cols["rank"], np.int64)
        if kind == Kind.RUN_START:
            self._run_start(rank, cols, now_ns)
            return
        rank = self._admit(rank)
        if not (rank >= 0).any():
            return
        self.ingest_seq += 1
        cols = {**cols, "rank": rank}
        self.last_row_ns = now_ns
        step = np.asarray(cols["step"], np.int64)
        end = np.asarray(cols["start_ns"], np.int64) + np.maximum(np.asarray(cols["duration_ns"], np.int64), 0)
        shift = self._receive_shift(rank, end, now_ns)
        self._heard(rank, end + shift, step, now_ns)
        if kind == Kind.HEARTBEAT:
            ok = rank >= 0
            hb = {k: (v[0][ok], v[1]) if isinstance(v, tuple) else np.asarray(v)[ok] for k, v in cols.items()}
            if self.receive_clock:
                since = np.asarray(hb["pending_since_ns"], np.int64)
                hb["start_ns"] = np.asarray(hb["start_ns"], np.int64) + shift[ok]
                hb["pending_since_ns"] = np.where(since > 0, since + shift[ok], since)
            self._heartbeat(rank[ok], hb)
            return
        if kind not in (Kind.STEP, Kind.COLLECTIVE, Kind.PIPE_INSTR, Kind.MEMORY, Kind.OFFLOAD, Kind.THROUGHPUT):
            return
        slots = self._slots_for(step, now_ns, rank)
        keep = (slots >= 0) & (rank >= 0)
        self.rows_too_old += int(((slots < 0) & (rank >= 0) & (step <= self.newest_step)).sum())
        if not keep.any():
            return
        slots, rank = slots[keep], rank[keep]
        d = self.data
        if kind == Kind.STEP:
            for name in _STEP_COLS:
                d[slots, F[name], rank] = np.asarray(cols[name], np.float64)[keep]
            for name in ("micro_batch", "micro_batches"):
                if name in cols:
                    d[slots, F[name], rank] = np.asarray(cols[name], np.float64)[keep]
            self.present[slots, rank] = True
            first = np.unique(slots)
            first = first[self.slot_step_first_ns[first] == 0]
            self.slot_step_first_ns[first] = now_ns
            end = np.asarray(cols["start_ns"], np.int64)[keep] + np.asarray(cols["duration_ns"], np.int64)[keep]
            np.maximum.at(self.slot_end_ns, slots, end)
            if "micro_batches" in cols:
                np.maximum.at(self.slot_micro_batches, slots, np.asarray(cols["micro_batches"], np.int64)[keep])
        elif kind == Kind.COLLECTIVE:
            self._collectives(slots, rank, cols, keep)
        elif kind == Kind.PIPE_INSTR:
            instr = _strings(cols["instr"])[keep]
            red = np.isin(instr, _REDUCE_INSTR)
            np.add.at(d, (slots[red], F["reduce_ns"], rank[red]), np.asarray(cols["duration_ns"], np.float64)[keep][red])
        elif kind == Kind.MEMORY:
            for name in ("rss_bytes", "allocated_bytes", "budget_bytes", "peak_bytes"):
                d[slots, F[name], rank] = np.asarray(cols[name], np.float64)[keep]
        elif kind == Kind.THROUGHPUT:
            d[slots, F["mfu"], rank] = np.asarray(cols["mfu"], np.float64)[keep]
            d[slots, F["tokens_per_s"], rank] = np.asarray(cols["tokens_per_s"], np.float64)[keep]
        elif kind == Kind.OFFLOAD:
            direction = _strings(cols["direction"])[keep]
            nb = np.asarray(cols["bytes"], np.float64)[keep]
            dur = np.asarray(cols["duration_ns"], np.float64)[keep]
            for dname, prefix in (("d2h", "d2h"), ("h2d", "h2d")):
                m = direction == dname
                np.add.at(d, (slots[m], F[prefix + "_bytes"], rank[m]), nb[m])
                np.add.at(d, (slots[m], F[prefix + "_ns"], rank[m]), dur[m])

    def _collectives(self, slots: np.ndarray, rank: np.ndarray, cols: dict, keep: np.ndarray) -> None:
        """Per-row flags computed once per dictionary entry (few), then indexed by the codes."""
        d = self.data
        op_codes, op_dict = cols["op"]
        role_codes, role_dict = cols["role"]
        op_codes, role_codes = np.asarray(op_codes)[keep], np.asarray(role_codes)[keep]
        p2p_d = np.array([r.startswith("p2p") for r in role_dict] or [False], bool)
        dp_d = np.array([("dp" in r.split("|")) for r in role_dict] or [False], bool)
        dp_like = np.array([("dp" in r) for r in role_dict] or [False], bool)  # the snapshot's grad-sync (SQL LIKE)
        grad_d = np.array([o.lstrip("_").startswith(GRAD_OPS) for o in op_dict] or [False], bool)
        dur = np.asarray(cols["duration_ns"], np.float64)[keep]
        nb = np.asarray(cols["bytes"], np.int64)[keep]
        p2p = p2p_d[role_codes]
        grad = dp_d[role_codes] & grad_d[op_codes] & (nb >= GRAD_MIN_BYTES)
        np.add.at(d, (slots[~p2p], F["coll_wait_ns"], rank[~p2p]), dur[~p2p])
        np.add.at(d, (slots[grad], F["grad_sync_ns"], rank[grad]), dur[grad])
        dpl = dp_like[role_codes]
        np.add.at(d, (slots[dpl], F["dp_coll_ns"], rank[dpl]), dur[dpl])
        np.add.at(d, (slots[p2p], F["p2p_ns"], rank[p2p]), dur[p2p])
        np.add.at(d, (slots[p2p], F["p2p_bytes"], rank[p2p]), nb[p2p].astype(np.float64))
        if p2p.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                rate = np.where(dur[p2p] > 0, nb[p2p] / dur[p2p], 0.0)
            np.maximum.at(self.best_p2p, slots[p2p], rate)
        # (op, role) signatures of non-p2p collectives, for the hang culprit test
        if (~p2p).any():
            pair = op_codes[~p2p].astype(np.int64) * max(1, len(role_dict)) + role_codes[~p2p]
            upair, inv = np.unique(pair, return_inverse=True)
            ubits = np.zeros(len(upair), np.int64)
            for j, code in enumerate(upair):
                key = (str(op_dict[code // max(1, len(role_dict))]), str(role_dict[code % max(1, len(role_dict))]))
                bit = self.sigs.get(key)
                if bit is None and len(self.sigs) < MAX_SIGS:
                    bit = self.sigs[key] = len(self.sigs)
                ubits[j] = (1 << bit) if bit is not None else 0
            np.bitwise_or.at(self.sigmask, (slots[~p2p], rank[~p2p]), ubits[inv])

    def _admit(self, rank: np.ndarray) -> np.ndarray:
        """The rows' ranks, -1 where refused (counted by reason): negative, outside the run's world
        size (or beyond PROVISIONAL_RANKS before it is known), or beyond the live state's budget."""
        bad = rank < 0
        self.refuse("negative_rank", int(bad.sum()))
        limit = self.rank_limit()
        out = rank >= limit
        if out.any():
            self.refuse("rank_outside_world" if self.world_size > 0 else "rank_before_world_size", int(out.sum()))
        rank = np.where(bad | out, -1, rank)
        top = int(rank.max())
        if top >= self.ranks and not self.ensure_ranks(top + 1):
            over = rank >= self.ranks
            self.refuse("live_state_full", int(over.sum()))
            rank = np.where(over, -1, rank)
        return rank

    def _receive_shift(self, rank: np.ndarray, t_ns: np.ndarray, now_ns: int) -> np.ndarray:
        """Per row: what to add to a rank's clock to put it on the collector's (see receive_clock);
        zeros when that is off."""
        if not self.receive_clock or not len(rank):
            return np.zeros(len(rank), np.int64)
        ok = rank >= 0
        newest = np.full(max(self.ranks, int(rank.max()) + 1, 1), np.iinfo(np.int64).min, np.int64)
        np.maximum.at(newest, rank[ok], t_ns[ok])
        return np.where(ok, now_ns - newest[np.maximum(rank, 0)], 0)

    def _heard(self, rank: np.ndarray, end_ns: np.ndarray, step: np.ndarray, now_ns: int) -> None:
        ok = rank >= 0
        rank, end_ns, step = rank[ok], end_ns[ok], step[ok]
        if not len(rank):
            return
        np.maximum.at(self.seen_ns, rank, end_ns)
        np.maximum.at(self.seen_step, rank, step)
        stepped = step >= 0
        self.rank_last[rank[stepped]] = step[stepped]  # the latest row of each rank in the batch wins
        self.rank_seq[rank[stepped]] = self.ingest_seq
        self.heard_at[rank] = now_ns
        pos = end_ns[end_ns > 0]
        if len(pos) and (self.first_ns <= 0 or int(pos.min()) < self.first_ns):
            self.first_ns = int(pos.min())

    def _run_start(self, rank: np.ndarray, cols: dict, now_ns: int = 0) -> None:
        world = np.minimum(np.asarray(cols["world_size"], np.int64), MAX_WORLD)
        ok = (rank >= 0) & (rank < world)
        self.refuse("rank_outside_world", int((~ok).sum()))
        self.refuse("world_size_capped", int((np.asarray(cols["world_size"], np.int64) > MAX_WORLD).sum()))
        rank = rank[ok]
        cols = {k: (v[0][ok], v[1]) if isinstance(v, tuple) else np.asarray(v)[ok] for k, v in cols.items()}
        if not len(rank):
            return
        self.world_size = max(self.world_size, int(world[ok].max()))
        if not self.ensure_ranks(int(rank.max()) + 1):
            keep = rank < self.ranks
            self.refuse("live_state_full", int((~keep).sum()))
            rank = rank[keep]
            cols = {k: (v[0][keep], v[1]) if isinstance(v, tuple) else np.asarray(v)[keep] for k, v in cols.items()}
            if not len(rank):
                return
        start = np.asarray(cols["start_ns"], np.int64)
        self._heard(rank, start, np.full(len(rank), -1, np.int64), now_ns)
        self.dp = int(np.max(cols["dp"])) or 1
        self.pp = int(np.max(cols["pp"])) or 1
        self.tp = int(np.max(cols["tp"])) or 1
        self.micro_batches = int(np.max(cols["micro_batches"]))
        fpt = np.asarray(cols["flops_per_token"], np.float64)
        if (~np.isnan(fpt)).any():
            self.flops_per_token = float(np.nanmax(fpt))
        self.stage[rank] = np.asarray(cols["stage"], np.int32)
        self.started[rank] = True
        if "hostname" in cols:
            self.hostname[rank] = _strings(cols["hostname"])

    def _heartbeat(self, rank: np.ndarray, cols: dict) -> None:
        order = np.argsort(np.asarray(cols["start_ns"]), kind="stable")  # the latest wins
        rank = rank[order]
        ns = np.asarray(cols["start_ns"], np.int64)[order]
        newer = ns >= self.hb_ns[rank]
        rank, ns, order = rank[newer], ns[newer], order[newer]
        first = self.hb_first_ns[rank] == 0
        self.hb_first_ns[rank[first]] = ns[first]
        self.hb_ns[rank] = ns
        step = self.hb_step[rank] = np.asarray(cols["step"], np.int64)[order]
        since = self.hb_since[rank] = np.asarray(cols["pending_since_ns"], np.int64)[order]
        op = self.hb_op[rank] = _strings(cols["pending_op"])[order]
        self.hb_role[rank] = _strings(cols["pending_role"])[order]
        self.hb_phase[rank] = _strings(cols["phase"])[order]
        held = (op != "") & (since > 0)  # (each row's own: a rank's later row in the batch wins)
        self.hb_held_ns[rank[held]] = ns[held] - since[held]
        self.hb_held_step[rank[held]] = step[held]

    # -- reading --------------------------------------------------------------------------
    def usual_sigs(self, rank_idx: np.ndarray) -> list[frozenset[tuple[str, str]]]:
        """(op, role) pairs each rank ran in the newest step it completed before the step its
        heartbeat is in (in the window): what it does every step, not what it is stuck in now."""
        names = {b: k for k, b in self.sigs.items()}
        out = []
        for r in rank_idx:
            mask = 0
            top = min(self.newest_step, int(self.hb_step[r]) - 1) if self.hb_step[r] >= 0 else self.newest_step
            for s in range(top, self.newest_step - self.window, -1):
                slot = self.slot_of(s) if s >= 0 else -1
                if slot >= 0 and self.present[slot, r]:
                    mask = int(self.sigmask[slot, r])
                    break
            out.append(frozenset(names[b] for b in names if mask >> b & 1))
        return out


@dataclass
class GpuState:
    node: str
    gpu: int
    last_ns: int = 0
    throttled: bool = False
    throttled_since_ns: int = 0
    ecc_uncorrected: float = 0.0
    mem_total_bytes: float = float("nan")
    xids: list[tuple[int, int, str]] = field(default_factory=list)  # (ns, xid, description), bounded


#: NVML clocks-event reasons counted as thermal/power throttling: HW slowdown (0x8), SW power cap
#: (0x4), SW thermal (0x20), HW thermal (0x40), HW power brake (0x80).
#: The live state's memory budget over all runs when none is given: a run that would grow past it
#: refuses the rows of its new ranks (counted `live_state_full`); 16,384 ranks x 64 steps take 235 MB.
#: A collector gives it its share of the memory cap (collector/app.py `MemoryBudget.live_bytes`).
MAX_LIVE_BYTES = 2 << 30

THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
MAX_XIDS = 64


class LiveState:
    """All runs' state, plus the agents' GPUs (node-level rows carry the run of the agent's batch)."""

    def __init__(self, window: int = 64, max_bytes: int = MAX_LIVE_BYTES) -> None:
        if window < 2:
            raise ValueError("the live window must hold at least 2 steps")
        self.window = window
        self.max_bytes = max_bytes
        self.runs: dict[str, RunState] = {}
        self.gpus: dict[tuple[str, int], GpuState] = {}
        self.evicted = 0
        self.refused_evicted: dict[str, int] = {}  # rows refused by runs evicted since (by reason)
        #: runs put heartbeat and "heard" times on the collector's clock (RunState.receive_clock)
        self.receive_clock = False

    def run(self, run_id: str) -> RunState:
        r = self.runs.get(run_id)
        if r is None:
            r = self.runs[run_id] = RunState(run_id, self.window)
            r.grow_room = self._grow_room
            r.receive_clock = self.receive_clock
        return r

    def _grow_room(self) -> int:
        return self.max_bytes - self.nbytes

    def evict(self, run_id: str) -> None:
        """Drop an ended run's state (its alerts and stored rows stay)."""
        r = self.runs.pop(run_id, None)
        if r is not None:
            self.evicted += 1
            for k, v in self._refused_of(r).items():
                self.refused_evicted[k] = self.refused_evicted.get(k, 0) + v

    @staticmethod
    def _refused_of(r: RunState) -> dict[str, int]:
        out = dict(r.refused)
        if r.rows_too_old:
            out["step_too_old"] = out.get("step_too_old", 0) + r.rows_too_old
        return out

    def refused(self, *, evicted: bool = False) -> dict[str, int]:
        """Rows refused by reason, over the runs held (and the runs' too-old rows); with `evicted`,
        those of the runs evicted since too (a count that never falls: /metrics)."""
        out: dict[str, int] = dict(self.refused_evicted) if evicted else {}
        for r in self.runs.values():
            for k, v in self._refused_of(r).items():
                out[k] = out.get(k, 0) + v
        return out

    def ingest(self, kind: Kind, run_id: str, cols: dict, now_ns: int) -> None:
        if kind == Kind.GPU_SAMPLE:
            self._gpu(cols)
        elif kind == Kind.XID:
            self._xid(cols)
        else:
            self.run(run_id).ingest(kind, cols, now_ns)

    def _gpu(self, cols: dict) -> None:
        nodes = _strings(cols["node"])
        for i in np.argsort(np.asarray(cols["start_ns"]), kind="stable"):
            key = (str(nodes[i]), int(cols["gpu"][i]))
            g = self.gpus.get(key) or self.gpus.setdefault(key, GpuState(*key))
            ns = int(cols["start_ns"][i])
            reasons = cols["clock_event_reasons"][i]
            throttled = bool(reasons == reasons and int(reasons) & THROTTLE_MASK)
            if throttled and not g.throttled:
                g.throttled_since_ns = ns
            g.throttled = throttled
            g.last_ns = ns
            ecc = cols["ecc_uncorrected"][i]
            if ecc == ecc:
                g.ecc_uncorrected = float(ecc)
            total = cols["mem_total_bytes"][i]
            if total == total:
                g.mem_total_bytes = float(total)

    def _xid(self, cols: dict) -> None:
        nodes, desc = _strings(cols["node"]), _strings(cols["description"])
        for i in range(len(nodes)):
            key = (str(nodes[i]), int(cols["gpu"][i]))
            g = self.gpus.get(key) or self.gpus.setdefault(key, GpuState(*key))
            g.xids.append((int(cols["start_ns"][i]), int(cols["xid"][i]), str(desc[i])))
            del g.xids[:-MAX_XIDS]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs.values())
