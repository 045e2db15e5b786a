#!/bin/bash
# onset -> firing for a straggler (rank 3, 150 ms from step 20, PP2xDP2) at a given TRACETOP_FLUSH_S
# usage: scripts/live_freshness.sh 1 5   (one run per TRACETOP_FLUSH_S value; prints onset -> firing per run)
set -u
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
d=$(mktemp -d)
.venv/bin/tracetop collector --db $d/f.duckdb --listen unix://$d/c.sock > $d/col.log 2>&1 &
cpid=$!
for i in $(seq 100); do grep -q listening $d/col.log && break; sleep 0.2; done
for f in "$@"; do
  TRACETOP_FLUSH_S=$f TRACETOP_ENDPOINT=unix://$d/c.sock TRACETOP_RUN_ID=flush$f timeout 400 .venv/bin/torchrun --standalone --nproc_per_node 4 -m reference_trainer --pp 2 --steps 30 --quiet --inject-straggler 3:150@20 > $d/run$f.log 2>&1
done
sleep 3; kill -TERM $cpid; wait $cpid
.venv/bin/tracetop query $d/f.duckdb "SELECT a.run_id, a.first_step, a.fired_step, round((a.fired_ns - s.start_ns) / 1e9, 2) AS onset_to_firing_s FROM alerts a JOIN step s ON s.run_id = a.run_id AND s.rank = 3 AND s.step = 20 WHERE a.signal = 'straggler' ORDER BY a.run_id"
