"""torchrun jobs for the tests: each in a session of its own, and every process it started marked
by a token in its environment (torchrun starts each rank in a session of its own, so the group alone
does not find them), so that whatever outlives the job is found and killed (a test never leaves
ranks behind), with the run's logs read back.

    r = torchrun(tmp_path, nproc=4, args=["--pp", "2", "--steps", "5"])      # the reference trainer
    r.rc, r.output, r.rows (rank 0's --log-jsonl), r.ranks[k] (rank k's --rank-log-dir rows)
    out = launch([sys.executable, "-m", "torch.distributed.run", ..., "my_loop.py"], timeout_s=300)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import ROOT

#: what every rank of a test job runs with (DeepSpeed on the CPU, one thread a rank)
JOB_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class RunResult:
    rc: int
    output: str
    rows: list[dict]
    ranks: dict[int, list[dict]]
    wall_s: float
    exit_unix_s: float
    leftover_pids: list[int] = field(default_factory=list)

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]

    def rank(self, k: int, key: str) -> list[float]:
        return [r[key] for r in self.ranks[k]]


@dataclass
class Launched:
    """A finished job: exit code, output, and the processes of its group that outlived it (killed)."""

    rc: int
    output: str
    wall_s: float
    exit_unix_s: float
    leftover_pids: list[int]


def launch(cmd: list[str], *, timeout_s: float = 400.0, env: dict[str, str] | None = None,
           cwd: Path = ROOT) -> Launched:
    """Run ``cmd`` to its end in a session of its own (JOB_ENV over ``env`` or os.environ). Fails the
    test after ``timeout_s``, killing the whole group; kills whatever of the group outlived it."""
    token = uuid.uuid4().hex
    full_env = dict(env if env is not None else os.environ, **JOB_ENV, **{JOB_TOKEN: token})
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_job(token)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[:6])} … did not finish in {timeout_s} s:\n{out[-3000:]}") from None
    exit_t, exit_unix_s = time.monotonic(), time.time()
    in_group = group_members(proc.pid)
    leftover = sorted(set(in_group) | set(job_members(token)))
    if in_group:
        os.killpg(proc.pid, signal.SIGKILL)
    kill_job(token)
    return Launched(proc.returncode, out, exit_t - t0, exit_unix_s, leftover)


#: the environment variable that marks every process of one test job (inherited by torchrun's ranks)
JOB_TOKEN = "TRACETOP_TEST_JOB"


def job_members(token: str) -> list[int]:
    """Live processes whose environment carries ``TRACETOP_TEST_JOB=token``, in whatever session."""
    needle = f"{JOB_TOKEN}={token}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2:].split()[0] != "Z":
            pids.append(int(d.name))
    return pids


def kill_job(token: str) -> None:
    for pid in job_members(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def torchrun(tmp: Path, *, nproc: int, args: list[str], timeout_s: float = 400.0, trace: bool = False,
             via_tracetop: bool = False, env: dict[str, str] | None = None) -> RunResult:
    """``torchrun -m reference_trainer`` (or ``tracetop train``, which execs the same) with logs in tmp;
    ``env``: the job's environment in place of os.environ (a job run from a thread beside another)."""
    tmp.mkdir(parents=True, exist_ok=True)
    log, rank_dir = tmp / "rank0.jsonl", tmp / "ranks"
    if via_tracetop:
        launcher = [sys.executable, "-m", "tracetop.cli", "train", "--nproc", str(nproc)]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                    "-m", "reference_trainer"]
    cmd = [*launcher, "--quiet", "--log-jsonl", str(log), "--rank-log-dir", str(rank_dir), *args]
    if not trace:
        cmd.append("--no-trace")
    job = launch(cmd, timeout_s=timeout_s, env=env)
    ranks = {int(p.stem[4:]): read_jsonl(p) for p in sorted(rank_dir.glob("rank*.jsonl"))}
    return RunResult(job.rc, job.output, read_jsonl(log), ranks, job.wall_s, job.exit_unix_s, job.leftover_pids)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def group_members(pgid: int) -> list[int]:
    """Live processes still in process group ``pgid`` (a job's session)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(d.name))
    return pids


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
