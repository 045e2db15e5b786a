"""Make tests/fixtures/straggler_run.duckdb: a real 4-rank PP2 x DP2 reference run (gloo, CPU)
with rank 3 made a straggler from step 20 (`--inject-straggler 3:150@20`), its hooks shipping to a
real collector over a unix socket.

    .venv/bin/python scripts/make_fixture.py --out tests/fixtures/straggler_run.duckdb

Tests that read the fixture derive what they expect from its raw tables or from this injection,
never from numbers copied out of one particular file, so the file can be regenerated at will.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STRAGGLER_RANK, STRAGGLER_MS, STRAGGLER_FROM = 3, 150, 20
RUN_ID = "fixture-straggler"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the DuckDB file to write (replaced)")
    ap.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from collector.loadgen import CollectorProcess

    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tracetop-fixture-") as tmp:
        db = Path(tmp) / "run.duckdb"
        listen = f"unix://{tmp}/c.sock"
        collector = CollectorProcess(db, listen)
        collector.start()
        env = dict(os.environ, TRACETOP_ENDPOINT=listen, TRACETOP_RUN_ID=RUN_ID, DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
               "-m", "reference_trainer", "--tp", "1", "--pp", "2", "--steps", str(args.steps), "--quiet",
               "--inject-straggler", f"{STRAGGLER_RANK}:{STRAGGLER_MS}@{STRAGGLER_FROM}"]
        try:
            rc = subprocess.call(cmd, env=env, cwd=ROOT)
        finally:
            stop_rc = collector.stop()
        if rc != 0 or stop_rc != 0:
            print(f"make_fixture: run exited {rc}, collector {stop_rc}; log {collector.log_path}", file=sys.stderr)
            return 1
        import duckdb

        con = duckdb.connect(str(db))
        con.execute("CHECKPOINT")
        con.close()
        tmp_out = out.with_suffix(".tmp")
        tmp_out.write_bytes(db.read_bytes())
        os.replace(tmp_out, out)
    print(f"make_fixture: wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
