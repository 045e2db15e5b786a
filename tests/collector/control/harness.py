"""The closed loop's tests: a real collector process, a real trainer under torchrun in the
background, and a client speaking the collector's Control and Query services."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from tests.support import ROOT
from tests.support.services import start_collector
from tests.support.torchrun import JOB_TOKEN, kill_job
from tests.support.wait import wait_for as wait_for_condition
from tracetop.wire import tracetop_pb2 as pb
from tracetop.wire import tracetop_pb2_grpc as pb_grpc


class Client:
    def __init__(self, addr: str) -> None:
        self.channel = grpc.insecure_channel(addr)
        self.control = pb_grpc.ControlStub(self.channel)
        self.query = pb_grpc.QueryStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def sql(self, sql: str) -> list[dict]:
        from collector.query import readonly

        reply = self.query.Sql(pb.QueryRequest(sql=sql), timeout=60)
        return readonly.from_ipc(reply.arrow_ipc).to_pylist()

    def set_micro_batch(self, run: str, n: int, by: str = "person:test") -> pb.ControlReply:
        return self.control.Submit(pb.ControlRequest(run_id=run, op=pb.PROPOSE, kind=pb.SET_MICRO_BATCH, int_value=n,
                                                     approve=True, by=by, rule="manual"), timeout=30)

    def offload(self, run: str, on: bool) -> pb.ControlReply:
        return self.control.Submit(pb.ControlRequest(run_id=run, op=pb.PROPOSE, kind=pb.OFFLOAD_OPTIMIZER,
                                                     int_value=int(on), approve=True, by="person:test"), timeout=30)

    def op(self, op: int, action_id: str) -> pb.ControlReply:
        return self.control.Submit(pb.ControlRequest(op=op, action_id=action_id, by="person:test"), timeout=30)

    def action(self, action_id: str) -> dict:
        rows = self.sql(f"SELECT * FROM actions WHERE action_id = '{action_id}'")
        return rows[0] if rows else {}

    def wait_action(self, action_id: str, states: tuple[str, ...], timeout_s: float = 180.0) -> dict:
        return wait_for(lambda: (a := self.action(action_id)) and a["state"] in states and a, timeout_s,
                        f"action {action_id} in {states}", lambda: self.action(action_id))


#: the loop's waits poll SQL through the collector: every 0.2 s is enough
wait_for = partial(wait_for_condition, every_s=0.2)


class Trainer:
    """``torchrun -m reference_trainer`` (or any module) in the background, in its own session."""

    def __init__(self, tmp: Path, *, nproc: int, args: list[str], env: dict[str, str], module: str = "reference_trainer",
                 script: str | None = None) -> None:
        self.rank_dir = tmp / "ranks"
        self.stop_file = tmp / "stop"  # the reference trainer's --stop-file (stop_after)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        target = [script] if script else ["-m", module, "--quiet", "--rank-log-dir", str(self.rank_dir),
                                          *(["--stop-file", str(self.stop_file)] if module == "reference_trainer" else [])]
        e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                 TRACETOP_COMMAND_POLL_S="0.5", **env)
        self.token = e[JOB_TOKEN] = uuid.uuid4().hex
        self.log = open(tmp / "trainer.log", "w")
        self.proc = subprocess.Popen([*launcher, *target, *args], cwd=ROOT, env=e, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.tmp = tmp

    def wait(self, timeout_s: float = 400.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            kill_job(self.token)
            raise AssertionError(f"trainer did not finish in {timeout_s} s:\n{self.output()[-3000:]}") from None
        finally:
            self.log.close()

    def stop_after(self, steps: int, *, at_least: int = 0) -> int:
        """Ask the reference trainer to end cleanly ``steps`` steps after the furthest one any rank
        has logged, and not before step ``at_least`` (--stop-file): every rank ends before the step
        returned, with rc 0. Tests call it once they have seen what they wait for, instead of
        running out a --steps chosen with slack."""
        import json

        logged = [json.loads(x)["step"] for p in self.rank_dir.glob("rank*.jsonl")
                  for x in p.read_text().splitlines() if x.strip().endswith("}")]  # a line being written: not yet
        stop = max(max(logged, default=-1) + 1 + steps, at_least)
        tmp = self.stop_file.with_suffix(".tmp")
        tmp.write_text(str(stop))
        tmp.replace(self.stop_file)  # whole, never half-written
        return stop

    def kill(self) -> None:
        """End the job, its ranks included: torchrun starts each rank in a session of its own, so
        killing torchrun's group alone leaves the ranks training. SIGTERM makes torchrun end them
        (and wait for them); SIGKILL only if it has not within 20 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        kill_job(self.token)  # any rank torchrun did not end

    def output(self) -> str:
        return (self.tmp / "trainer.log").read_text()

    def rank_rows(self) -> dict[int, list[dict]]:
        import json

        return {int(p.stem[4:]): [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
                for p in sorted(self.rank_dir.glob("rank*.jsonl"))}


def changes(rows: list[dict]) -> list[tuple[int, tuple[int, int]]]:
    """(step, (micro_batch, micro_batches)) wherever the shape differs from the step before."""
    out = []
    for a, b in zip(rows, rows[1:]):
        if (a["micro_batch"], a["micro_batches"]) != (b["micro_batch"], b["micro_batches"]):
            out.append((b["step"], (b["micro_batch"], b["micro_batches"])))
    return out


@dataclass
class Loop:
    """One closed-loop run: the collector process, a client to it, the trainer under torchrun."""

    collector: Any
    client: Client
    trainer: Trainer
    run_id: str

    def sql(self, sql: str) -> list[dict]:
        return self.client.sql(sql)

    def run_rows(self, table: str, columns: str) -> list[dict]:
        """``columns`` of ``table`` for this run, by rank and step."""
        return self.client.sql(f"SELECT {columns} FROM {table} WHERE run_id = '{self.run_id}' ORDER BY rank, step")


@contextlib.contextmanager
def loop_run(tmp: Path, run_id: str, trainer_args: list[str], *, controller: str = "off", toml: str | None = None,
             collector_args: list[str] = (), env: dict[str, str] | None = None,  # type: ignore[assignment]
             command_every_steps: int = 5, nproc: int = 2, script: str | None = None) -> Iterator[Loop]:
    """Start a collector (``--controller MODE``, the [controller] TOML if given), a client, and
    ``nproc`` ranks of the reference trainer (or ``script``) shipping to it as ``run_id`` (flush every 0.5 s,
    the command boundary every ``command_every_steps`` steps); stop all three on the way out."""
    extra = ["--controller", controller, *collector_args]
    if toml is not None:
        (tmp / "c.toml").write_text(toml)
        extra += ["--controller-config", str(tmp / "c.toml")]
    c = start_collector(tmp, extra_args=extra)
    client = Client(c.addr)
    t = None
    try:
        t = Trainer(tmp, nproc=nproc, args=trainer_args,
                    env={"TRACETOP_ENDPOINT": c.addr, "TRACETOP_RUN_ID": run_id, "TRACETOP_FLUSH_S": "0.5",
                         "TRACETOP_COMMAND_EVERY_STEPS": str(command_every_steps), **(env or {})}, script=script)
        yield Loop(c, client, t, run_id)
    finally:
        if t is not None:
            t.kill()
        client.close()
        c.stop()
