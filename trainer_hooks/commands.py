"""Commands into a running job: every rank applies one at the same step boundary, or none does.

Path: the collector -> rank 0's subscriber thread (``Control.Poll`` when the collector's Push reply
says commands wait, else every 60 s; every ``TRACETOP_COMMAND_POLL_S``, default 5 s, where the
receiver does not say or the variable is set; no stream held open; trainer_hooks/control_link.py) -> an inbox ->
every K steps (``TRACETOP_COMMAND_EVERY_STEPS``, default 10) all ranks join one fixed-size
broadcast (8 int64, 64 bytes) from rank 0 on a gloo group the hooks create beside the training's
groups -> each rank applies the command through the trainer's entry point -> one fixed-size
all-reduce (MIN) of "did it apply here" -> each rank reports its outcome (``Control.Report``).

Why no hang and no device sync: the broadcast runs only at a step boundary (before a step, on the
training thread, outside every training collective), and every rank reaches every boundary
because the step numbers are the training loop's own. It is a CPU tensor on a gloo group, so the
device is never touched and the training's groups (NCCL on GPU) see no extra call. Most
boundaries it carries "nothing" (word 0 is 0) and that is all that happens: the all-reduce and
the trainer's entry point run only when a command came, and then on every rank, since every rank
read the same broadcast. A failure of the gloo group itself (its timeout, default 600 s) turns
the command path off on that rank, logged; the training goes on.

All or none, and how it is guaranteed:

1. Every rank receives the same command at the same boundary (one broadcast from rank 0), so
   every rank calls its entry point for it before the same step S.
2. Right after, still before step S, every rank contributes ``world_size`` if it applied the
   command and its own rank if it could not, to one all-reduce MIN. Every rank gets the same
   answer: ``world_size`` (all applied) or the lowest failing rank.
3. If any rank failed, every rank that applied it undoes it at once (the entry point called with
   the value in force before), still before step S. So step S runs with the old setting on every
   rank, or with the new one on every rank; no training step ever runs with ranks disagreeing.
4. Each rank reports: applied, rejected (its reason), undone (and why), or undo failed (its
   reason; the only case the guarantee cannot cover, reported as such, never hidden).

A command is handed to the ranks only before its ``expires_ns`` (rank 0's clock): a command
delayed past it is dropped at rank 0 and reported, and the collector marks it lost; a late
delivery never applies it.

Two ways a trainer applies commands:

- ``tracer.on_command(kind, fn)`` (any trainer: plain PyTorch DDP, HF, Lightning): the Tracer
  runs the boundary when a step begins; ``fn(value)`` applies (raise to refuse); the undo calls
  ``fn(previous)`` with ``current()`` read before applying (default for ``micro_batch``: the
  Tracer's micro_batch; for ``offload``: the last value applied, off at first; for ``rebalance``,
  whose value is a ``trainer_hooks.rebalance.Rebalance``: the last one applied, at first the
  balanced split of the same global batch).
- the reference trainer's seam: ``tracing.adjustments(step)`` (-> ``receive``),
  ``adjustment_result`` (-> ``settle``), ``adjustment_undone`` (-> ``undone``).

PROFILE (a profiling window, trainer_hooks/profiling.py) is the hooks' own: no handler, both ways
land in ``profiling.Windows.take`` (the bus's ``windows``). Wherever a boundary runs (handlers, the seam) windows are taken
(``TRACETOP_PROFILE=0``: refused). With ``TRACETOP_PROFILE=1`` the Tracer also runs the boundary with
no handler registered, every 50 steps unless K is set (``profile_every_steps``), never at step 0. Not
by default: the boundary is a collective, and a job where some rank does not trace the same steps
(a Tracer on rank 0 only) would hang in it.

Every rank must use the same one, with the same K: the hooks' configuration is the same on every
rank of a job (it comes from the same environment).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracetop import env as tenv
from trainer_hooks import profiling
from trainer_hooks.control_link import ControlLink

log = logging.getLogger("trainer_hooks")

#: wire CommandKind number -> the trainer-side key (the same keys as the reference trainer's --adjust)
KINDS = {1: "micro_batch", 2: "offload", 3: "rebalance", 4: "profile"}
KIND_CODES = {v: k for k, v in KINDS.items()}
WORDS = 8  # the broadcast: [has command, action id, kind, value, is rollback, len(values), 0, 0]
#: a command's list argument (Command.values) travels in a second broadcast of exactly its length,
#: only at a boundary that carries such a command; longer lists are refused at rank 0
MAX_VALUES = 65536
DEFAULT_EVERY_STEPS = 10
GROUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Pending:
    """A command every rank received at ``step``'s boundary."""

    step: int
    action_id: int
    key: str
    value: Any  # int for micro_batch, bool for offload, a Rebalance for rebalance
    rollback: bool
    values: tuple[int, ...] = ()  # the command's list argument (rebalance, profile)


def every_steps_from_env() -> int:
    raw = tenv.get(tenv.TRACETOP_COMMAND_EVERY_STEPS, str(DEFAULT_EVERY_STEPS)) or ""
    try:
        k = int(raw)
    except ValueError:
        from trainer_hooks.identity import SetupError

        raise SetupError(f"trainer_hooks: {tenv.TRACETOP_COMMAND_EVERY_STEPS}={raw!r} is not a whole number of "
                         f"steps; use e.g. {DEFAULT_EVERY_STEPS}, or 0 to turn commands off") from None
    return max(0, k)


class CommandBus:
    """One rank's end of the command path (see the module docstring). Made by the Tracer; costs
    nothing until a boundary is reached (no thread, no group, no channel before that)."""

    def __init__(self, tracer: Any, *, every_steps: int | None = None, endpoint: str | None = None,
                 drop: str | None = None, channel_factory: Callable[[str], Any] | None = None,
                 clock_ns: Callable[[], int] = time.time_ns, subscribe: bool = True) -> None:
        self.t = tracer
        self.subscribe = subscribe  # False: no subscriber thread on rank 0 (the broadcast benchmark)
        self.stats = {"boundaries": 0, "commands": 0, "received": 0, "dropped": 0, "reports_sent": 0,
                      "reports_failed": 0, "boundary_ns": 0, "polls": 0}
        # rank 0's subscriber and every rank's reporter: threads of their own, started when needed
        self.link = ControlLink(tracer, kinds=KINDS, max_values=MAX_VALUES, stats=self.stats, endpoint=endpoint,
                                drop=drop, channel_factory=channel_factory, clock_ns=clock_ns)
        self.inbox = self.link.inbox  # rank 0: the commands taken, read at the next boundary
        self.every_steps = every_steps_from_env() if every_steps is None else max(0, int(every_steps))
        self._clock_ns = clock_ns
        self.handlers: dict[str, tuple[Callable[[Any], Any], Callable[[], Any] | None]] = {}
        # profiling windows (trainer_hooks/profiling.py): taken wherever a boundary runs (handlers,
        # the reference trainer's seam); with TRACETOP_PROFILE=1 a plain Tracer or trainer_hooks.auto,
        # with no handler, runs the boundary for them alone
        self.windows = profiling.Windows(self)
        self.profile_alone = self.windows.enabled and profiling.boundary_alone()
        # with no handler registered the boundary serves profiling windows alone: every
        # profiling.EVERY_STEPS steps (a window may start a little later; the broadcast costs a fifth),
        # unless TRACETOP_COMMAND_EVERY_STEPS (or every_steps) says otherwise
        explicit = every_steps is not None or tenv.get(tenv.TRACETOP_COMMAND_EVERY_STEPS) is not None
        self.profile_every_steps = self.every_steps if explicit or self.every_steps <= 0 else profiling.EVERY_STEPS
        self.external = False  # the reference trainer's seam drives the boundary
        self.broken = False
        self.closed = False
        self._group: Any = None
        self._ready = False
        self._buf: Any = None
        self._flag: Any = None
        self._bcast: Any = None
        self._allreduce: Any = None
        self._min: Any = None
        self._offload_state = False
        self._rebalance: Any = None  # the Rebalance in force (None: balanced, as started)

    # ------------------------------------------------------------------ API
    @property
    def driving(self) -> bool:
        """True when the Tracer should run the boundary itself (handlers registered, or profiling
        windows on; no seam)."""
        return ((self.profile_alone or bool(self.handlers)) and not self.external and self.every_steps > 0
                and not self.broken)

    def on_command(self, kind: str, fn: Callable[[Any], Any], current: Callable[[], Any] | None = None) -> None:
        if kind not in KIND_CODES:
            raise ValueError(f"on_command({kind!r}): the commands are {sorted(KIND_CODES)}")
        self.handlers[kind] = (fn, current)

    def boundary(self, step: int) -> None:
        """The on_command flow at ``step``'s boundary (all ranks); nothing unless ``driving``."""
        if not self.driving:
            return
        p = self.receive(step)
        if p is None:
            return
        if p.key == "profile":
            self.windows.take(p)
            return
        fn, current = self.handlers.get(p.key, (None, None))
        previous = self._current(p, current)
        ok, message = True, ""
        if fn is None:
            ok, message = False, f"this trainer registered no handler for {p.key} (tracer.on_command)"
        else:
            try:
                fn(p.value)
            except Exception as e:
                ok, message = False, f"{type(e).__name__}: {e}"
        if self.settle(p, ok, message) or not ok:
            return
        try:
            fn(previous)  # type: ignore[misc]
            self.undone(p, True, f"{p.key} back to {previous}")
        except Exception as e:
            self.undone(p, False, f"undo to {p.key}={previous} failed: {type(e).__name__}: {e}")

    def profile(self, p: Pending) -> None:
        """A PROFILE command at ``p.step``'s boundary (the reference trainer's seam lands here)."""
        self.windows.take(p)

    def _current(self, p: Pending, current: Callable[[], Any] | None) -> Any:
        if current is not None:
            return current()
        if p.key == "rebalance":
            return self._rebalance if self._rebalance is not None else p.value.balanced()
        return self.t.micro_batch if p.key == "micro_batch" else self._offload_state

    # ------------------------------------------------------------------ the collective part
    def receive(self, step: int) -> Pending | None:
        """At every K-th step's boundary, on every rank: one broadcast from rank 0. Returns the
        command every rank received, or None (most boundaries)."""
        alone = not (self.handlers or self.external)  # the boundary serves profiling windows alone
        k = self.profile_every_steps if alone else self.every_steps
        if k <= 0 or self.broken or self.closed or step % k or (alone and step < k):
            # profiling alone: not at step 0. Its first boundary creates the command group, and a
            # rank that starts late would leave its peers waiting there, outside every collective
            # the run records, instead of in the training's first all-reduce, where the judgment
            # "never heard from, while ranks … wait in all_reduce" sees them
            return None
        t0 = time.perf_counter_ns()
        try:
            if not self._ready:
                self._setup()
                if self.broken:
                    return None
            values: tuple[int, ...] = ()
            if self._group is None:  # one process: nothing to broadcast, no tensor work on the training thread
                words = [0] * WORDS
                if self.t.rank == 0:
                    values = self._fill(words)
            else:
                buf = self._buf
                buf.zero_()
                if self.t.rank == 0:
                    values = self._fill(buf)
                self._bcast(buf, src=self._src, group=self._group)
                words = buf.tolist()
                if words[0] and words[5] > 0:  # every rank read the same length: every rank joins
                    import torch

                    payload = torch.tensor(values, dtype=torch.int64) if self.t.rank == 0 else \
                        torch.zeros(int(words[5]), dtype=torch.int64)
                    self._bcast(payload, src=self._src, group=self._group)
                    values = tuple(int(v) for v in payload.tolist())
            self.stats["boundaries"] += 1
        except Exception as e:
            self._break("broadcast", e)
            return None
        finally:
            self.stats["boundary_ns"] += time.perf_counter_ns() - t0
        if not words[0]:
            return None
        self.stats["commands"] += 1
        key = KINDS.get(int(words[2]), "")
        value: Any = bool(words[3]) if key == "offload" else int(words[3])
        if key == "rebalance":
            from trainer_hooks.rebalance import Rebalance

            value = Rebalance(values, int(words[3]))
        return Pending(step, int(words[1]), key, value, bool(words[4]), values)

    def settle(self, p: Pending, applied: bool, message: str = "") -> bool:
        """Right after applying (or failing to), on every rank: True when every rank applied it.
        Reports this rank's result, except when it must undo (``undone`` reports then)."""
        lowest_failed = self.t.world_size
        try:
            if self._group is not None:
                flag = self._flag
                flag[0] = self.t.world_size if applied else self.t.rank
                self._allreduce(flag, op=self._min, group=self._group)
                lowest_failed = int(flag[0])
            elif not applied:
                lowest_failed = self.t.rank
        except Exception as e:
            self._break("agreement", e)
            lowest_failed = -1
        all_ok = lowest_failed >= self.t.world_size
        if all_ok:
            self._in_force(p)
            self._report(p, True, message or f"{p.key}={p.value} applied at step {p.step}")
        elif not applied:
            self._report(p, False, message or "refused here")
        else:
            self._why_undo = (f"rank {lowest_failed} could not apply it" if lowest_failed >= 0
                              else "the ranks could not agree (the command group failed)")
        return all_ok

    def undone(self, p: Pending, ok: bool, message: str = "") -> None:
        """This rank applied ``p``, another could not: it undid it (``ok``) or failed to."""
        why = getattr(self, "_why_undo", "another rank could not apply it")
        stage = 2 if ok else 3  # CommandStage UNDONE / UNDO_FAILED
        self._report(p, False, f"applied, then undone before step {p.step}: {why}; {message}".rstrip("; "),
                     stage=stage)

    def _in_force(self, p: Pending) -> None:
        t = self.t
        if p.key == "micro_batch":
            mb, mbs = int(t.micro_batch), int(t.micro_batches)
            if mb > 0 and mbs > 0 and (mb * mbs) % p.value == 0:
                t.micro_batches = mb * mbs // p.value
            t.micro_batch = p.value
        elif p.key == "offload":
            self._offload_state = bool(p.value)
        elif p.key == "rebalance":
            self._rebalance = p.value
            if p.value.dp == t.world_size:  # one rank a replica (plain DDP): its STEP rows count its share
                t.samples_per_step = p.value.share(t.rank)

    def _setup(self) -> None:
        import torch

        self._buf = torch.zeros(WORDS, dtype=torch.int64)
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._src = 0
        dist: Any = None
        try:
            import torch.distributed

            if torch.distributed.is_available() and torch.distributed.is_initialized() and self.t.world_size > 1:
                dist = torch.distributed
        except ImportError:
            dist = None
        if dist is None and self.t.world_size > 1:
            # Several ranks but no process group to agree through: applying on rank 0 alone would
            # break "all or none", so this job takes no commands.
            self.broken = True
            say = log.warning if self.handlers or self.external else log.debug  # profiling alone: quietly
            say("trainer_hooks: rank %d: world size %d but torch.distributed is not initialized; "
                        "commands are off (they need every rank to agree)", self.t.rank, self.t.world_size)
            self._ready = True
            return
        if dist is not None:
            from datetime import timedelta

            # Beside the training's groups: every rank creates it here, at its first boundary.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
            self._src = dist.get_global_rank(self._group, 0) if hasattr(dist, "get_global_rank") else 0
            # the originals: tracetop does not time its own calls as the training's collectives
            self._bcast = getattr(dist.broadcast, "__wrapped__", dist.broadcast)
            self._allreduce = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)
            self._min = dist.ReduceOp.MIN
        if self.t.rank == 0 and self.subscribe:
            self.link.start_subscriber()
        self._ready = True

    def _fill(self, buf: Any) -> tuple[int, ...]:
        """Rank 0: the next command from the inbox that has not expired; returns its list argument."""
        now = self._clock_ns()
        while self.inbox:
            cmd = self.inbox.popleft()
            if cmd.expires_ns and now > cmd.expires_ns:
                self._report_raw(cmd.command_id, False, -1, "expired at rank 0 before a step boundary came; "
                                 "not handed to any rank, nothing applied")
                continue
            buf[0], buf[1], buf[2], buf[3] = 1, int(cmd.command_id), int(cmd.kind), int(cmd.int_value)
            buf[4] = 1 if cmd.rollback_of else 0
            values = tuple(int(v) for v in getattr(cmd, "values", ()))
            buf[5] = len(values)
            return values
        return ()

    def _break(self, where: str, e: BaseException) -> None:
        self.broken = True
        self.t.recorder.hook_error(f"commands {where}", e)
        log.warning("trainer_hooks: rank %d turns the command path off (%s failed: %r); training goes on",
                    self.t.rank, where, e)

    def _report(self, p: Pending, applied: bool, message: str, stage: int = 0) -> None:
        self._report_raw(str(p.action_id), applied, p.step, message, stage=stage)

    def _report_raw(self, command_id: str, applied: bool, step: int, message: str, stage: int = 0) -> None:
        self.link.report(command_id, applied, step, message, stage)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads after the last reports are out (up to timeout_s)."""
        if self.closed:
            return
        self.closed = True
        self.link.close(timeout_s)
