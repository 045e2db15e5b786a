"""What an idle Tracer's threads cost: a Tracer shipping to a real collector, one step, then 30 s
idle; per-thread CPU (utime+stime, 10 ms ticks) from /proc/self/task, in ms per second.
Run from the project root: DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m trainer_hooks.bench.probe_idle_threads"""

import os
import tempfile
import time
from pathlib import Path

from tracetop import procs
from trainer_hooks import Tracer

tmp = Path(tempfile.mkdtemp())
c = procs.collector(tmp / "collector.duckdb").start()
t = Tracer(endpoint=c.address, run_id="idle", rank=0, world_size=1)
with t.step(0):
    pass


def cpu_by_thread():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[(tid, name)] = (int(f[11]) + int(f[12]))  # utime+stime ticks
        except Exception:
            pass
    return out


time.sleep(2)
a = cpu_by_thread()
t0 = time.time()
time.sleep(30)
b = cpu_by_thread()
dt = time.time() - t0
hz = os.sysconf("SC_CLK_TCK")
tot = 0
for k in sorted(b):
    d = (b[k] - a.get(k, 0)) / hz * 1000 / dt
    tot += d
    if d > 0:
        print(f"{k[1]:24s} {d:.3f} ms/s")
print("total", round(tot, 3), "ms/s")
t.close()
c.stop()
