"""Reference trainer with the hooks always on; each suspect piece timed in place by the training
thread's CPU clock (thread_time_ns), per step, after a warmup of 30 steps.

    .venv/bin/tracetop collector --db /tmp/p.duckdb --listen 127.0.0.1:0 &   # note its address
    TRACETOP_ENDPOINT=ADDR DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python \
        -m reference_trainer.bench.probe_hook_costs --quiet --steps 300 --model tiny --micro-batches 4
"""
import collections
import json
import sys
import time

from reference_trainer import tracing as tracing_mod
from reference_trainer import train
from trainer_hooks.integrations import ddp as ddp_mod

tt = time.thread_time_ns
cost = collections.defaultdict(int)
calls = collections.defaultdict(int)
state = {"n": 0}
WARM = 30

def timed(name, fn):
    def w(*a, **k):
        if state["n"] < WARM:
            return fn(*a, **k)
        t0 = tt()
        try:
            return fn(*a, **k)
        finally:
            cost[name] += tt() - t0
            calls[name] += 1
    return w

real_start = tracing_mod.start
def start(engine, args, *, meta):
    traced = real_start(engine, args, meta=meta)
    t = traced.tracer
    peak = t.step_peak
    peak.take = timed("peak.take", peak.take)
    t.set_loss = timed("tracer.set_loss", t.set_loss)
    traced.adjustments = timed("adjustments", traced.adjustments)
    rec = t.recorder
    rec.begin_step = timed("recorder.begin_step", rec.begin_step)
    rec.end_step = timed("recorder.end_step", rec.end_step)
    state["tracer"] = t
    state["engine"] = engine
    real_step = traced.step
    def step(n):
        state["n"] = n
        if n == WARM:
            state["t0"] = tt()
        return real_step(n)
    traced.step = step
    real_close = traced.close
    def close():
        state["t1"] = tt()
        state["handle"] = ddp_mod.watching()
        state["ddp_calls"] = ddp_mod.watched_calls()
        state["instr_map"] = "_INSTRUCTION_MAP" in engine.__dict__
        real_close()
    traced.close = close
    return traced
tracing_mod.start = start
rc = train.main(sys.argv[1:])
steps = state["n"] - WARM + 1
tot = state["t1"] - state["t0"]
print(json.dumps({"steps": steps, "thread_us_per_step": tot / steps / 1e3,
                  "per_step_us": {k: round(v / steps / 1e3, 2) for k, v in cost.items()},
                  "calls_per_step": {k: calls[k] / steps for k in calls},
                  "ddp_handle_alive_at_end": state["handle"], "ddp_calls": state["ddp_calls"],
                  "pipelined": state["instr_map"]}, indent=1))
