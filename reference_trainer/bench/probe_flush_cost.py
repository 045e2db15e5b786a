"""Reference trainer, hooks always on: CPU of the hooks' threads (process CPU minus the training
thread's, minus the threads that existed before the hooks) per second, over the steps after a
warmup; TRACETOP_FLUSH_S picks the interval. Run it interleaved (5, 1, 5, 1), same collector:

    TRACETOP_FLUSH_S=1 TRACETOP_ENDPOINT=ADDR DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python \
        -m reference_trainer.bench.probe_flush_cost --quiet --steps 430 --model tiny --micro-batches 4
"""
import json
import os
import sys
import threading
import time

from reference_trainer import tracing as tracing_mod
from reference_trainer import train

WARM = 30
st = {"n": 0}
def tids(): return {int(t) for t in os.listdir("/proc/self/task")}
def cpu(ts):
    s = 0
    for t in ts:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                s += int(f.read().split()[0])
        except OSError:
            pass
    return s
real_start = tracing_mod.start
def start(engine, args, *, meta):
    st["base"] = tids() - {threading.get_native_id()}
    traced = real_start(engine, args, meta=meta)
    real_step = traced.step
    def step(n):
        if n == WARM:
            st["a"] = (time.process_time_ns(), time.thread_time_ns(), cpu(st["base"]), time.perf_counter(), n)
        st["n"] = n
        return real_step(n)
    traced.step = step
    real_close = traced.close
    def close():
        st["b"] = (time.process_time_ns(), time.thread_time_ns(), cpu(st["base"]), time.perf_counter(), st["n"] + 1)
        st["sh"] = traced.tracer.shipper.stats()
        real_close()
    traced.close = close
    return traced
tracing_mod.start = start
train.main(sys.argv[1:])
a, b = st["a"], st["b"]
proc, main_, base, wall, steps = (b[0]-a[0]), (b[1]-a[1]), (b[2]-a[2]), b[3]-a[3], b[4]-a[4]
hook = proc - main_ - base
print(json.dumps({"flush_s": os.environ.get("TRACETOP_FLUSH_S", "default"), "steps": steps, "wall_s": round(wall, 1),
                  "train_thread_ms_per_step": round(main_ / steps / 1e6, 3),
                  "hook_threads_ms_per_s": round(hook / wall / 1e6, 3),
                  "hook_threads_pct_of_step_cpu": round(hook / steps / (main_ / steps) * 100, 3),
                  "batches_sent": st["sh"].get("batches_sent"), "load": os.getloadavg()[0]}))
