"""Fault injection with real effects, and the per-rank clocks that show them.

Every fault acts on the real run, never on a reported number:

- straggler RANK:MS[@STEP]: that rank sleeps MS per step inside its forward (split across its
  micro-batches), so its compute is longer and its peers wait for it in their collectives;
- comm delay RANK:MS[@STEP]: that rank sleeps MS right before the step's first data-parallel
  gradient reduction (the engine's ``allreduce_gradients``, or a ZeRO 2/3 bucket reduction during
  backward), so it enters its DP collectives late; nothing in ``torch.distributed`` is wrapped,
  so hooks that wrap it see the late entry as it is;
- stage imbalance STAGE:FACTOR[@STEP]: every rank of that pipeline stage measures its forward and
  its backward and, from STEP, sleeps inside each (FACTOR - 1) times its median of the last 16
  such measurements before STEP, so the stage is FACTOR x slower than it was (the median: a rank
  descheduled once on a busy host does not have that delay multiplied into the fault, which made
  one rank of the stage a straggler; fixed at onset as slow rank's: a rolling median followed
  the stage's own speed after the onset, and on a busy host the sleeping stage computes faster,
  so the fault read 1.9-2.2 x for a FACTOR of 3). From step 0 (no measurement before it) the
  median of the last 16 measurements;
- slow rank RANK:FACTOR[@STEP]: a straggler proportional to the step: from STEP that rank sleeps
  (FACTOR - 1) x the median wall time of its own steps before STEP, every step, inside its forward
  (split across its micro-batches). A fixed MS is half a step on an idle machine and a fifth of one
  at load 3; this is FACTOR x at any load (the baseline is fixed at onset, so the wait it causes
  does not feed back into it);
- slow samples RANK:FACTOR@STEP[-END]: a straggler proportional to the work the rank does, so
  that fewer samples relieve it (the rebalance's fault): from STEP until before END that rank, in
  each forward, sleeps (FACTOR - 1) x its per-sample time x the samples of that micro-batch, the
  per-sample time being the median of its own step walls before STEP over the samples of each
  (fixed at onset, as slow rank's). FACTOR 1.5 makes a rank 50 % slower at any load;
- memory growth RANK:MB[@STEP]: that rank allocates, touches and holds MB more every step (host
  memory on CPU, device memory on GPU);
- hang RANK@STEP: at STEP, where its first DP reduction would start, that rank enters an
  all-reduce on a (gloo) group nobody else joins, where it stays until the timeout; the others
  block in their next collective with it until theirs.
- slow micro-batch MB:MS or MB:xFACTOR (``--inject-slow-micro-batch``; every rank): while the
  micro-batch size is MB, every step is MS longer, or FACTOR x the median wall of this rank's last 16
  steps at its other sizes (the control loop's "this change made it slower": a fixed MS is most of
  a step on an idle machine and too little of one at load 6, where CI's verification then kept the
  change; FACTOR holds at any load), slept inside the forwards (split across the micro-batches);
- kill RANK@STEP: in its first forward of STEP (mid-step) that rank sends itself SIGKILL: no
  finally, no atexit, no flush; what its hooks held in memory dies with it. The others fail in
  their next collective with it (gloo: the peer's connection closed) and end as their code does.

``StageClock`` also measures, per rank and step, the forward time of the stage module, the
backward time of the stage and the time in the DP gradient reduction (``--rank-log-dir``).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

from tracetop.errors import TracetopError

KINDS = ("straggler", "slow_rank", "slow_samples", "comm_delay", "stage_imbalance", "mem_growth", "hang", "kill")
_SPEC = {
    "straggler": (r"^(\d+):(\d+(?:\.\d+)?)(?:@(\d+))?$", "RANK:MS[@STEP], e.g. 1:200@5"),
    "slow_rank": (r"^(\d+):(\d+(?:\.\d+)?)(?:@(\d+))?$", "RANK:FACTOR[@STEP], e.g. 3:2@30"),
    "slow_samples": (r"^(\d+):(\d+(?:\.\d+)?)(?:@(\d+)(?:-(\d+))?)?$", "RANK:FACTOR@STEP[-END], e.g. 3:1.5@20-45"),
    "comm_delay": (r"^(\d+):(\d+(?:\.\d+)?)(?:@(\d+))?$", "RANK:MS[@STEP], e.g. 0:150"),
    "stage_imbalance": (r"^(\d+):(\d+(?:\.\d+)?)(?:@(\d+))?$", "STAGE:FACTOR[@STEP], e.g. 1:3"),
    "mem_growth": (r"^(\d+):(\d+(?:\.\d+)?)(?:@(\d+))?$", "RANK:MB[@STEP], e.g. 2:64@3"),
    "hang": (r"^(\d+)@(\d+)$", "RANK@STEP, e.g. 3@10"),
    "kill": (r"^(\d+)@(\d+)$", "RANK@STEP, e.g. 1@5"),
}


class FaultSpecError(TracetopError, ValueError):
    """An --inject-* value that cannot be used; the message says which and how to write it."""


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    target: int  # a global rank, or a pipeline stage for stage_imbalance
    amount: float  # ms, ms, factor, MB; 0 for hang
    from_step: int  # first step it acts on
    to_step: int = -1  # the first step it no longer acts on; -1: never ends

    def active(self, step: int) -> bool:
        if self.kind in ("hang", "kill"):
            return step == self.from_step
        return step >= self.from_step and (self.to_step < 0 or step < self.to_step)


def parse_fault(kind: str, text: str) -> Fault:
    pattern, form = _SPEC[kind]
    m = re.match(pattern, text.strip())
    flag = "--inject-" + kind.replace("_", "-")
    if not m:
        raise FaultSpecError(f"{flag} {text!r}: expected {form}")
    if kind in ("hang", "kill"):
        return Fault(kind, int(m.group(1)), 0.0, int(m.group(2)))
    amount = float(m.group(2))
    if kind in ("stage_imbalance", "slow_rank", "slow_samples") and amount < 1.0:
        raise FaultSpecError(f"{flag} {text!r}: FACTOR must be at least 1 (1 = no effect)")
    if kind == "slow_samples":
        start, end = int(m.group(3) or 0), int(m.group(4)) if m.group(4) else -1
        if start < 1:
            raise FaultSpecError(f"{flag} {text!r}: give STEP >= 1: the per-sample time is measured on the steps before it")
        if 0 <= end <= start:
            raise FaultSpecError(f"{flag} {text!r}: END ({end}) must come after STEP ({start})")
        return Fault(kind, int(m.group(1)), amount, start, end)
    return Fault(kind, int(m.group(1)), amount, int(m.group(3) or 0))


@dataclasses.dataclass(frozen=True)
class SlowMicroBatch:
    """--inject-slow-micro-batch: at that micro-batch size, ``ms`` longer every step, or ``factor`` x
    the step as this rank measured it at its other sizes (1: none)."""

    ms: float = 0.0
    factor: float = 1.0


_NOT_SLOW = SlowMicroBatch()


def parse_slow_micro_batch(specs: list[str]) -> dict[int, SlowMicroBatch]:
    """``--inject-slow-micro-batch`` values (MB:MS or MB:xFACTOR), by micro-batch size."""
    out = {}
    for text in specs:
        m = re.match(r"^(\d+):(x?)(\d+(?:\.\d+)?)$", text.strip())
        if not m or int(m.group(1)) < 1:
            raise FaultSpecError(f"--inject-slow-micro-batch {text!r}: expected MB:MS or MB:xFACTOR with MB >= 1, "
                                 "e.g. 2:1500 or 2:x4")
        amount = float(m.group(3))
        if m.group(2) and amount < 1.0:
            raise FaultSpecError(f"--inject-slow-micro-batch {text!r}: FACTOR must be at least 1 (1 = no effect)")
        out[int(m.group(1))] = SlowMicroBatch(factor=amount) if m.group(2) else SlowMicroBatch(ms=amount)
    return out


def parse_faults(args: Any, *, world_size: int, pp: int) -> list[Fault]:
    """All --inject-* flags of ``args``, checked against the layout."""
    faults = []
    for kind in KINDS:
        for text in getattr(args, "inject_" + kind, []) or []:
            f = parse_fault(kind, text)
            flag = "--inject-" + kind.replace("_", "-")
            if kind == "stage_imbalance":
                if f.target >= pp:
                    raise FaultSpecError(f"{flag} {text!r}: stage {f.target} does not exist with --pp {pp} "
                                         f"(stages 0..{pp - 1})")
            elif f.target >= world_size:
                raise FaultSpecError(f"{flag} {text!r}: rank {f.target} does not exist in a world of "
                                     f"{world_size} (ranks 0..{world_size - 1})")
            faults.append(f)
    return faults


def _sleep_s(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class StageClock:
    """This rank's faults and clocks. ``begin_step`` / ``end_step`` bracket every step.

    ``micro_batches`` returns how many forwards this rank runs per step (it changes when the
    micro-batch size is adjusted)."""

    def __init__(self, faults: list[Fault], *, rank: int, stage: int, micro_batches: Callable[[], int],
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = _sleep_s,
                 micro_batch: Callable[[], int] = lambda: 0, activation_bytes_per_sample: int = 0,
                 slow_micro_batch: dict[int, SlowMicroBatch] | None = None, sample_ms: float = 0.0) -> None:
        self.rank = rank
        self.sample_ms = float(sample_ms)  # --sample-ms: simulated device time per sample, every rank
        self._micro_batch = micro_batch
        # activation-like pressure: each forward holds bytes x micro-batch until its backward
        self.activation_bytes_per_sample = int(activation_bytes_per_sample)
        self.activations: list[Any] = []
        self.slow_micro_batch = dict(slow_micro_batch or {})  # micro-batch size -> its slowdown
        self.shape_walls: list[float] = []  # this rank's last 16 step walls at sizes not slowed by a factor
        self._step_mb = 0  # the micro-batch size of the running step (seen by its first forward)
        self.stage = stage
        self._micro_batches = micro_batches
        self._clock = clock
        self._sleep = sleep
        self.straggler = [f for f in faults if f.kind == "straggler" and f.target == rank]
        self.comm_delay = [f for f in faults if f.kind == "comm_delay" and f.target == rank]
        self.imbalance = [f for f in faults if f.kind == "stage_imbalance" and f.target == stage]
        self.slow_rank = [f for f in faults if f.kind == "slow_rank" and f.target == rank]
        self.step_walls: list[float] = []  # this rank's step wall times before its slow_rank onset
        self.slow_samples = [f for f in faults if f.kind == "slow_samples" and f.target == rank]
        self.sample_walls: list[float] = []  # this rank's step wall per sample before its slow_samples onset
        self._step_samples = 0  # samples this rank's forwards saw in the running step
        self._step_t0: float | None = None
        self.mem_growth = [f for f in faults if f.kind == "mem_growth" and f.target == rank]
        self.hang = [f for f in faults if f.kind == "hang" and f.target == rank]
        self.kill = [f for f in faults if f.kind == "kill" and f.target == rank]
        self.needs_hang_group = any(f.kind == "hang" for f in faults)
        self.hang_group: Any = None
        self.device: Any = None
        self.held: list[Any] = []  # memory-growth allocations, kept alive on purpose
        self.step = -1
        self._in_reduction = self._entered_reduction = False
        self.forward_s = self.backward_s = self.dp_reduce_s = 0.0
        self._fwd_t0 = self._fwd_c0 = self._bwd_t0 = 0.0
        self._fwd_base = _Baseline()  # a stage imbalance's measured forwards / backwards
        self._bwd_base = _Baseline()

    # -- step boundaries ------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        now = self._clock()
        if self._step_t0 is not None and self.slow_rank and not any(f.active(step - 1) for f in self.slow_rank):
            self.step_walls.append(now - self._step_t0)
        if (self._step_t0 is not None and self.slow_samples and self._step_samples > 0
                and all(step - 1 < f.from_step for f in self.slow_samples)):
            self.sample_walls.append((now - self._step_t0) / self._step_samples)
        if self._step_t0 is not None and self._step_mb and self.slow_micro_batch.get(self._step_mb, _NOT_SLOW).factor <= 1.0:
            self.shape_walls.append(now - self._step_t0)
            del self.shape_walls[:-16]
        self._step_samples = 0
        self._step_mb = 0
        self._step_t0 = now
        self.step = step
        self._entered_reduction = False
        self.forward_s = self.backward_s = self.dp_reduce_s = 0.0
        self.activations.clear()  # whatever a step left (none after a full backward)
        for f in self.mem_growth:
            if f.active(step):
                self._grow(f.amount)

    def _grow(self, mb: float) -> None:
        import torch

        n = int(mb * 2**20) // 4
        # ones, not empty: the pages must be touched to count against the process.
        self.held.append(torch.ones(n, dtype=torch.float32, device=self.device))

    def _factor(self) -> float:
        factor = max((f.amount for f in self.imbalance if f.active(self.step)), default=1.0)
        if self.imbalance and getattr(self.device, "type", "cpu") == "cuda":
            # Kernels run asynchronously: wait for them, so the clock reads compute, not launches.
            # Only the imbalanced stage does this (before the onset too: its baseline is measured).
            import torch

            torch.cuda.synchronize()
        return factor

    # -- installation -----------------------------------------------------------------------
    def install(self, engine: Any, stage_module: Any, embedding: Any | None) -> None:
        """Hook the stage module (forward timing, straggler, imbalance, backward markers) and the
        engine's DP gradient reduction (timing, comm delay, hang)."""
        stage_module.register_forward_pre_hook(self._pre_forward)
        stage_module.register_forward_hook(self._post_forward)
        if embedding is not None:
            embedding.register_forward_hook(self._after_embedding)
        # Where DP gradient reductions start: the engine's allreduce_gradients (ZeRO 0/1, the
        # pipeline's ReduceGrads, the ZeRO 2/3 epilogue), the bf16 pipeline path, and the ZeRO 2/3
        # bucket reductions that run from gradient hooks during backward. Instance attributes
        # shadow the methods: DeepSpeed calls them as self.<name>().
        for owner, name in ((engine, "allreduce_gradients"), (engine, "_bf16_reduce_grads"),
                            (engine.optimizer, "reduce_ipg_grads"),
                            (engine.optimizer, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")):
            original = getattr(owner, name, None)
            if callable(original):
                setattr(owner, name, self._reduction(original))

    def _reduction(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def reduction(*a: Any, **kw: Any) -> Any:
            if self._in_reduction:  # nested (the epilogue calls the bucket reduction): counted once
                return original(*a, **kw)
            self._in_reduction = True
            t0 = self._clock()
            try:
                if not self._entered_reduction:  # the step's first DP reduction
                    self._entered_reduction = True
                    for f in self.hang:
                        if f.active(self.step):
                            self._hang()
                    self._sleep(sum(f.amount for f in self.comm_delay if f.active(self.step)) / 1000.0)
                    t0 = self._clock()
                return original(*a, **kw)
            finally:
                self.dp_reduce_s += self._clock() - t0
                self._in_reduction = False

        return reduction

    def _hang(self) -> None:
        import torch
        import torch.distributed as dist

        print(f"[reference_trainer] rank {self.rank}: injected hang at step {self.step}: entering an "
              "all-reduce no other rank joins", flush=True)
        dist.all_reduce(torch.zeros(1), group=self.hang_group)  # a gloo group: blocks until its timeout
        raise RuntimeError("injected hang: the all-reduce returned, which it must not")

    # -- forward ------------------------------------------------------------------------------
    def _pre_forward(self, module: Any, args: tuple) -> tuple | None:
        if any(f.active(self.step) for f in self.kill):
            _kill_self(self.rank, self.step)
        self._factor()  # on GPU, an imbalanced stage starts its clock with an empty queue
        self._fwd_t0 = self._clock()
        ms = sum(f.amount for f in self.straggler if f.active(self.step))
        ms += self._slow_micro_batch_ms()
        ms += self._slow_rank_ms()
        n = _batch_size(args)
        self._step_samples += n
        training = getattr(module, "training", True)
        slow_ms = (self._slow_samples_ms(n) + self.sample_ms * n) if training else 0.0
        if self.activation_bytes_per_sample and module.training:
            import torch

            n = self.activation_bytes_per_sample * max(1, self._micro_batch()) // 4
            self.activations.append(torch.ones(n, dtype=torch.float32, device=self.device))
        if ms:
            self._sleep(ms / 1000.0 / max(1, self._micro_batches()))
        if slow_ms:
            self._sleep(slow_ms / 1000.0)
        self._fwd_c0 = self._clock()
        if self.stage > 0 and args:
            first = args[0]
            if isinstance(first, tuple):
                return ((_wrap_end(first[0], self), *first[1:]), *args[1:])
            return (_wrap_end(first, self), *args[1:])
        return None

    def _slow_samples_ms(self, samples: int) -> float:
        """slow samples: (FACTOR - 1) x the per-sample time measured before onset x this forward's samples."""
        factor = max((f.amount for f in self.slow_samples if f.active(self.step)), default=1.0)
        if factor <= 1.0 or not self.sample_walls or samples <= 0:
            return 0.0
        walls = sorted(self.sample_walls)
        return (factor - 1.0) * walls[len(walls) // 2] * samples * 1000.0

    def _slow_micro_batch_ms(self) -> float:
        self._step_mb = mb = self._micro_batch()
        slow = self.slow_micro_batch.get(mb, _NOT_SLOW)
        if slow.factor > 1.0 and self.shape_walls:
            return slow.ms + (slow.factor - 1.0) * statistics.median(self.shape_walls) * 1000.0
        return slow.ms

    def _slow_rank_ms(self) -> float:
        factor = max((f.amount for f in self.slow_rank if f.active(self.step)), default=1.0)
        if factor <= 1.0 or not self.step_walls:
            return 0.0
        walls = sorted(self.step_walls)
        return (factor - 1.0) * walls[len(walls) // 2] * 1000.0

    def _post_forward(self, module: Any, args: tuple, output: Any) -> Any:
        factor = self._factor()
        if self.imbalance and (s := self._fwd_base.sleep_s(self._clock() - self._fwd_c0, factor)) > 0.0:
            self._sleep(s)
        self.forward_s += self._clock() - self._fwd_t0
        if isinstance(output, tuple):
            return (_wrap_start(output[0], self), *output[1:])
        return _wrap_start(output, self)

    def _after_embedding(self, module: Any, args: tuple, output: Any) -> Any:
        return _wrap_end(output, self)

    # -- backward (called from the autograd markers) -----------------------------------------
    def backward_started(self) -> None:
        self._factor()
        self._bwd_t0 = self._clock()

    def backward_ended(self) -> None:
        factor = self._factor()
        if self.imbalance and (s := self._bwd_base.sleep_s(self._clock() - self._bwd_t0, factor)) > 0.0:
            self._sleep(s)
        self.backward_s += self._clock() - self._bwd_t0
        if self.activations:  # this micro-batch's activations are freed with its backward (1F1B: FIFO)
            self.activations.pop(0)


@dataclasses.dataclass
class _Baseline:
    """A stage imbalance's measured forwards (or backwards): the last 16 before its onset, which
    fix the sleep from it; with none (onset at step 0), the last 16 since."""

    before: list[float] = dataclasses.field(default_factory=list)
    since: list[float] = dataclasses.field(default_factory=list)

    def sleep_s(self, measured: float, factor: float) -> float:
        """The sleep after a forward (backward) that measured ``measured`` s: none before the onset."""
        if factor <= 1.0:
            self.before.append(measured)
            del self.before[:-16]
            return 0.0
        if self.before:
            return (factor - 1.0) * statistics.median(self.before)
        self.since.append(measured)
        del self.since[:-16]
        return (factor - 1.0) * statistics.median(self.since)


def _batch_size(args: tuple) -> int:
    """The samples of a forward: the first dimension of its first tensor argument (0: none)."""
    first = args[0] if args else None
    if isinstance(first, tuple) and first:
        first = first[0]
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else 0


def _kill_self(rank: int, step: int) -> None:
    import os
    import signal

    print(f"[reference_trainer] rank {rank}: injected kill at step {step}: SIGKILL mid-step", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _markers():
    import torch

    class BackwardStart(torch.autograd.Function):
        """Identity; its backward runs first in the stage's backward."""

        @staticmethod
        def forward(ctx, x, clock):  # type: ignore[override]
            ctx.clock = clock
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            ctx.clock.backward_started()
            return grad, None

    class BackwardEnd(torch.autograd.Function):
        """Identity; its backward runs last in the stage's backward."""

        @staticmethod
        def forward(ctx, x, clock):  # type: ignore[override]
            ctx.clock = clock
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            ctx.clock.backward_ended()
            return grad, None

    return BackwardStart, BackwardEnd


_MARKERS: tuple | None = None


def _wrap(x: Any, clock: StageClock, which: int) -> Any:
    global _MARKERS
    import torch

    if not (isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()):
        return x
    if _MARKERS is None:
        _MARKERS = _markers()
    return _MARKERS[which].apply(x, clock)


def _wrap_start(x: Any, clock: StageClock) -> Any:
    return _wrap(x, clock, 0)


def _wrap_end(x: Any, clock: StageClock) -> Any:
    return _wrap(x, clock, 1)
