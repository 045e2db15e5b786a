"""``--stop-file PATH``: end the run cleanly at a step every rank agrees on.

Whoever wants the run to end (a person, a scheduler's pre-emption hook, a test that has seen what
it waited for) writes a step number N into PATH; every rank then ends before step N, or at the next
step boundary when N is not ahead of the run, and exits 0 through the normal path (hooks closed,
logs flushed, the checkpoint of the last step saved if --save-dir is set).

Only rank 0 reads the file, and it broadcasts what it read to every rank on a gloo group at every
step boundary: the ranks cannot disagree on the step (a file only some ranks see, a rank a step
ahead of another, a write landing between two ranks' reads), so none ends while another waits in a
collective for it. The cost is one 8-byte CPU broadcast per step, only when the option is given.

Write the file whole (write a temporary file, then rename it over PATH): content that is not an
integer (an empty or half-written file) is ignored until it is one. A file left from an earlier
run ends the next run that names it at its first step boundary: remove it before relaunching.
"""

from __future__ import annotations

#: what the broadcast carries when there is no stop step (no file yet, or not an integer)
NONE = -1


def read_stop_step(path: str) -> int | None:
    """The step N written in ``path`` (the run ends before it), or None: no file, or not an integer."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    try:
        return max(0, int(text))
    except ValueError:
        return None


class StopFile:
    """The agreed stop step. Call :meth:`should_stop` on every rank at every step boundary."""

    def __init__(self, path: str, rank: int) -> None:
        import torch.distributed as dist

        self.path = path
        self.rank = rank
        # every rank takes part in creating the group; gloo so a CPU tensor serves under NCCL too
        self.group = dist.new_group(backend="gloo")
        self.stop_step: int | None = None

    def should_stop(self, step: int) -> bool:
        """True on every rank, at the same ``step``, once rank 0 has read a stop step <= ``step``."""
        import torch
        import torch.distributed as dist

        if self.stop_step is None:
            seen = read_stop_step(self.path) if self.rank == 0 else None
            t = torch.tensor([NONE if seen is None else seen], dtype=torch.int64)
            dist.broadcast(t, src=0, group=self.group)
            if int(t.item()) != NONE:
                self.stop_step = int(t.item())  # agreed: no further collective needed
        return self.stop_step is not None and step >= self.stop_step


def describe(stop: StopFile, step: int) -> str:
    """The line rank 0 prints when it stops."""
    asked = stop.stop_step
    return (f"[reference_trainer] stopping before step {step}: {stop.path} asked for step {asked}"
            + ("" if asked == step else f" (reached at the next step boundary, {step})"))

