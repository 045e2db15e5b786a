"""A stand-in hook process: ships N known STEP rows through the shared shipper, paced over D s.

    python hook_proc.py ENDPOINT RANK N DURATION_S RUN_ID

Row i has rank=RANK and step=i, so the test can check every (rank, step) is stored exactly once.
Prints `hook RANK acked` and exits 0 once the receiver acked everything, 1 if it did not in time.
"""

from __future__ import annotations

import sys
import time

from tracetop.events import Kind
from tracetop.wire.shipper import Shipper


def main() -> int:
    endpoint, rank, n, duration_s, run_id = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
        sys.argv[5],
    )
    s = Shipper(endpoint, run_id=run_id, source_id=f"hook-{rank}", rank=rank, flush_interval_s=0.1)
    t0 = time.monotonic()
    chunk = max(1, n // max(1, int(duration_s * 20)))  # ~20 bursts a second
    i = 0
    while i < n:
        for _ in range(min(chunk, n - i)):
            s.record(Kind.STEP, rank, i, time.time_ns(), 1000, 1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1, 1)
            i += 1
        due = t0 + duration_s * i / n
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    ok = s.flush(timeout_s=240)
    stats = s.stats()
    s.close(1)
    print(f"hook {rank} {'acked' if ok else 'NOT acked'} dropped={stats['rows_dropped']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
