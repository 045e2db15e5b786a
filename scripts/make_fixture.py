"""Make the TUI's fixture file: a real 4-rank PP2 x DP2 reference run with an injected straggler.

    .venv/bin/python scripts/make_fixture.py --out tests/fixtures/straggler_run.duckdb

What runs (all real): a collector process on a unix socket, a node agent with 4 fake GPUs
(agent/fake_nvml.py, the hardware edge; node name = the hostname, as in the ranks' rows) relaying to it, and torchrun launching 4 DeepSpeed ranks
(`--pp 2`, DP 2) of the reference trainer with `--inject-straggler 3:150@20` (rank 3 sleeps 150 ms
per step in its forward from step 20 on), whose hooks ship through the agent. The collector is
stopped (SIGTERM: everything acked is committed), then the file is checkpointed and copied to
--out. Tests read expected values from the file's raw tables or from this known injection
(STRAGGLER_RANK, STRAGGLER_MS, STRAGGLER_FROM_STEP below), never hard-coded numbers.

Where the collector has the live engine's `alerts` / `actions` tables, the file carries them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRAGGLER_RANK = 3
STRAGGLER_MS = 150
STRAGGLER_FROM_STEP = 20
STEPS = 30
RUN_ID = "fixture-straggler"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="where the DuckDB file goes (overwritten)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    args = p.parse_args(argv)

    from collector.bench.loadgen import CollectorProcess, wait_ready

    out: Path = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tracetop-fixture-") as tmp:
        work = Path(tmp)
        db = work / "run.duckdb"
        listen = f"unix://{work / 'collector.sock'}"
        agent_sock = f"unix://{work / 'agent.sock'}"
        collector = CollectorProcess(db, listen)
        collector.start()
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRACETOP_RUN_ID=RUN_ID,
                   TRACETOP_FLUSH_S="1", TRACETOP_HEARTBEAT_S="1", PYTHONUNBUFFERED="1")
        agent = subprocess.Popen(
            [sys.executable, "-m", "tracetop.cli", "agent", "--collector", listen, "--listen", agent_sock,
             "--fake-gpus", "4", "--interval-s", "0.5", "--run-id", RUN_ID,
             "--spool-dir", str(work / "spool"), "--clock-interval-s", "0"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        rc = 1
        try:
            wait_ready(agent_sock, 60, agent)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   "-m", "reference_trainer", "--quiet", "--tp", "1", "--pp", "2", "--steps", str(args.steps),
                   "--inject-straggler", f"{STRAGGLER_RANK}:{STRAGGLER_MS}@{STRAGGLER_FROM_STEP}"]
            print("make_fixture: " + " ".join(cmd[2:]), flush=True)
            rc = subprocess.call(cmd, cwd=ROOT, env=dict(env, TRACETOP_ENDPOINT=agent_sock))
            time.sleep(2.0)  # the agent's last samples and relayed batches reach the collector
        finally:
            agent.terminate()
            agent.wait(60)
            collector.stop()
        if rc != 0:
            print(f"make_fixture: the training run failed (exit {rc})", file=sys.stderr)
            return rc
        import duckdb

        con = duckdb.connect(str(db))
        con.execute("CHECKPOINT")
        n = con.execute("SELECT count(*) FROM step WHERE run_id = ?", [RUN_ID]).fetchone()[0]
        con.close()
        shutil.copyfile(db, out)
    print(f"make_fixture: {out} ({out.stat().st_size / 1e6:.1f} MB, {n} step rows, run {RUN_ID})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
