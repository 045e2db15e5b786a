"""Run by test_spool.py in a process of its own: a shipper with a spool, and an agent relay in front
of it with a hook shipping through it, while RLIMIT_FSIZE makes every spool write fail with EFBIG
(what a full disk does with ENOSPC), then with the limit lifted. Prints one JSON line.

    python -m tests.wire.disk_full_proc COLLECTOR_ADDR SPOOL_DIR RELAY_SOCK
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time
from pathlib import Path

from tracetop.events import SCHEMAS, Kind
from tracetop.wire.shipper import Shipper


def record_steps(s: Shipper, steps: range, rank: int) -> None:
    names = [c.name for c in SCHEMAS[Kind.STEP]]
    for st in steps:
        row = dict.fromkeys(names, 0)
        row.update(rank=rank, step=st)
        s.record(Kind.STEP, *(row[n] for n in names))


def main() -> None:
    from agent.relay import Relay

    collector, spool, sock = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    out: dict = {}
    agent = Shipper(collector, run_id="disk", spool_dir=spool, flush_interval_s=60)
    relay = Relay(agent, [f"unix://{sock}"]).start()
    hook = Shipper(f"unix://{sock}", run_id="disk", rank=1, flush_interval_s=60)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # every batch file is bigger: EFBIG
        record_steps(agent, range(0, 50), rank=0)  # the agent's own rows
        out["own_flushed_while_full"] = agent.flush(30)
        record_steps(hook, range(0, 50), rank=1)  # a hook's rows, through the relay
        out["hook_flushed_while_full"] = hook.flush(3)
        out["spool_bytes_while_full"] = agent.stats()["spool_bytes"]
        out["tmp_files"] = [str(p) for p in spool.rglob("*.tmp")]
        out["spool_write_errors"] = agent.stats()["spool_write_errors"]
        out["relay_refusals"] = relay.stats()["spool_full"]
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # the disk has room again
        out["hook_flushed_after"] = hook.flush(30)
        record_steps(hook, range(50, 100), rank=1)
        out["hook_flushed_more"] = hook.flush(30)
        record_steps(agent, range(50, 100), rank=0)
        out["own_flushed_after"] = agent.flush(30)
        for _ in range(100):  # acked files are removed just after the ack that flush() waits for
            if agent.stats()["spool_bytes"] == 0:
                break
            time.sleep(0.05)
        out["batch_files_left"] = len(list(spool.rglob("*.batch")))
        out["hook_stats"] = {k: hook.stats()[k] for k in ("rows_dropped", "batches_acked")}
        out["agent_stats"] = {k: agent.stats()[k] for k in ("rows_dropped", "spool_bytes", "unacked_batches")}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        hook.close(5)
        relay.stop()
        agent.close(10)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
