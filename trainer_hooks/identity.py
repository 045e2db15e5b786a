"""Who this process is: rank, world size, local rank and run id, from the launcher's variables.

Resolution order for each field: an explicit argument, then the launcher's variables (torchrun and
the deepspeed launcher set RANK / WORLD_SIZE / LOCAL_RANK; Slurm sets SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID), then a single-process default. The run id comes from TRACETOP_RUN_ID, then the
launcher's job id (TORCHELASTIC_RUN_ID, SLURM_JOB_ID), then a timestamp. Pure: the environment is
a parameter.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tracetop import env as tenv
from tracetop.errors import TracetopError

_RUN_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_RUN_ID_BAD_CHARS = re.compile(r"[^A-Za-z0-9._:-]+")


class SetupError(TracetopError, ValueError):
    """A configuration the hooks cannot start with; the message says what to change."""


@dataclass(frozen=True)
class Identity:
    rank: int
    world_size: int
    local_rank: int
    run_id: str
    launcher: str  # torchrun | slurm | none | explicit


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError as e:
        raise SetupError(f"trainer_hooks: {name}={raw!r} is not an integer; fix the launcher's environment") from e


def sanitize_run_id(raw: str) -> str:
    """A launcher job id made safe for TRACETOP_RUN_ID's alphabet (``[A-Za-z0-9._:-]``, 1-128)."""
    cleaned = _RUN_ID_BAD_CHARS.sub("-", raw.strip()).strip("-")[:128]
    return cleaned or "run"


def resolve(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    run_id: str | None = None,
    environ: Mapping[str, str] | None = None,
    clock_s=time.time,
) -> Identity:
    environ = os.environ if environ is None else environ
    launcher = "explicit" if rank is not None else "none"
    if "RANK" in environ or "WORLD_SIZE" in environ:
        env_rank, env_world, env_local = _int(environ, "RANK"), _int(environ, "WORLD_SIZE"), _int(environ, "LOCAL_RANK")
        if rank is None:
            launcher = "torchrun"
    elif "SLURM_PROCID" in environ:
        env_rank, env_world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
        env_local = _int(environ, "SLURM_LOCALID")
        if rank is None:
            launcher = "slurm"
    else:
        env_rank = env_world = env_local = None
    rank = rank if rank is not None else (env_rank if env_rank is not None else 0)
    world_size = world_size if world_size is not None else (env_world if env_world is not None else 1)
    local_rank = local_rank if local_rank is not None else (env_local if env_local is not None else 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise SetupError(
            f"trainer_hooks: rank {rank} is outside a world of {world_size}; pass rank= and world_size= "
            "that agree, or launch with torchrun / srun"
        )

    if run_id is None:
        explicit = environ.get(tenv.TRACETOP_RUN_ID, "")
        if explicit:
            run_id = explicit
        else:
            job = environ.get("TORCHELASTIC_RUN_ID", "") or environ.get("SLURM_JOB_ID", "")
            # torchrun's default rdzv id is "none"; that is no run id.
            run_id = sanitize_run_id(job) if job and job != "none" else time.strftime("run-%Y%m%d-%H%M%S", time.gmtime(clock_s()))
    if not _RUN_ID_OK.match(run_id):
        raise SetupError(
            f"trainer_hooks: run id {run_id!r} must be 1-128 characters of [A-Za-z0-9._:-]; "
            f"set {tenv.TRACETOP_RUN_ID} to e.g. {sanitize_run_id(run_id)!r}"
        )
    return Identity(rank=rank, world_size=world_size, local_rank=local_rank, run_id=run_id, launcher=launcher)
