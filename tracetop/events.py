"""The event model: every event kind, its columns and their dtypes, and the schema version.

This is the one place column names and dtypes are defined. The wire (tracetop/wire/codec.py)
encodes and checks batches against it, the collector derives its DuckDB tables from it, and
producers record rows in the column order given here.

Every row of every kind starts with the same four columns, so any row can be placed:

    rank         int32   the global rank (-1 for node-level rows from the agent)
    step         int64   the training step it belongs to (-1 where none applies)
    start_ns     int64   the producer's wall clock (time.time_ns) at the start of the event
    duration_ns  int64   a monotonic duration (0 for point events)

The run id travels once per batch (ColumnBatch.run_id); the collector adds it as a column.

Dtypes: "i4"/"i8" little-endian integers, "f8" little-endian float64 (NaN = unknown, stored as
NULL), "str" dictionary-encoded strings (int32 codes + a dictionary on the wire).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

#: Bumped whenever a column is added, removed or retyped. The collector refuses other versions
#: with a message saying which side to upgrade.
SCHEMA_VERSION = 3
#: The oldest schema a collector still reads: an agent or trainer not yet upgraded, or a spool written
#: before the upgrade, keeps being stored (a rolling upgrade loses nothing). Its batch lacks the
#: columns appended since (`APPENDED_IN`), which read as NaN; only float columns may be appended.
OLDEST_READ_SCHEMA = 2


class Kind(IntEnum):
    """Mirrors tracetop.v1.EventKind (a test checks the two agree)."""

    RUN_START = 1
    STEP = 2
    COLLECTIVE = 3
    PIPE_INSTR = 4
    OFFLOAD = 5
    MEMORY = 6
    THROUGHPUT = 7
    GPU_SAMPLE = 8
    HOST_SAMPLE = 9
    HEARTBEAT = 10
    GAP = 11
    XID = 12
    CLOCK_OFFSET = 13
    GPU_PROCESS = 14


class Col(NamedTuple):
    name: str
    dtype: str  # "i4" | "i8" | "f8" | "str"


_COMMON = (Col("rank", "i4"), Col("step", "i8"), Col("start_ns", "i8"), Col("duration_ns", "i8"))

#: Columns of each kind, in the order producers pass them to Shipper.record().
SCHEMAS: dict[Kind, tuple[Col, ...]] = {
    Kind.RUN_START: _COMMON
    + (
        Col("world_size", "i4"),
        Col("tp", "i4"),
        Col("pp", "i4"),
        Col("dp", "i4"),
        Col("zero_stage", "i4"),
        Col("stage", "i4"),             # this rank's pipeline stage (-1 without a pipeline)
        Col("model_name", "str"),
        Col("n_params", "i8"),
        Col("flops_per_token", "f8"),   # model FLOPs per token (fwd+bwd); NaN if undeclared
        Col("peak_flops", "f8"),        # device peak FLOP/s used for MFU; NaN if unknown
        Col("micro_batch", "i4"),
        Col("micro_batches", "i4"),     # gradient accumulation steps / pipeline micro-batches
        Col("seq_len", "i4"),
        Col("hostname", "str"),
        Col("pid", "i4"),
        Col("ds_config_json", "str"),
        Col("meta_json", "str"),        # anything else the integration knows (launcher, versions)
    ),
    Kind.STEP: _COMMON
    + (
        Col("data_wait_ns", "i8"),
        Col("forward_ns", "i8"),
        Col("backward_ns", "i8"),
        Col("optimizer_ns", "i8"),
        Col("comm_exposed_ns", "i8"),   # collective time on the training thread not hidden by compute
        Col("compute_ns", "i8"),        # forward + backward + optimizer, excluding collective waits
        Col("tokens", "i8"),
        Col("samples", "i8"),
        # schema 2: appended (a file migrates with ALTER TABLE ... ADD COLUMN, so new columns go last)
        Col("loss", "f8"),              # the step's training loss; NaN where the trainer did not give it
        Col("micro_batch", "i4"),       # micro-batch size in force during this step (-1 unknown)
        Col("micro_batches", "i4"),     # micro-batches (gradient accumulation steps) in force (-1 unknown)
    ),
    Kind.COLLECTIVE: _COMMON
    + (
        Col("op", "str"),               # all_reduce, all_gather_into_tensor, send, recv, ...
        Col("role", "str"),             # tp | pp | dp | mp | world | p2p:pp | joined with '|'
        Col("group_size", "i4"),
        Col("bytes", "i8"),             # payload bytes per rank (NCCL-tests "size")
        Col("peer", "i4"),              # p2p peer global rank, -1 for collectives
        Col("dtype", "str"),
        Col("is_async", "i4"),          # 1 if the call returned a work handle
    ),
    Kind.PIPE_INSTR: _COMMON
    + (
        Col("stage", "i4"),
        Col("micro_batch", "i4"),       # -1 where the instruction has no micro-batch
        Col("instr", "str"),            # ForwardPass, BackwardPass, SendActivation, ...
    ),
    Kind.OFFLOAD: _COMMON
    + (
        Col("direction", "str"),        # d2h | h2d | h2nvme | nvme2h | h2h
        Col("what", "str"),             # grads | optim_state | params
        Col("bytes", "i8"),
    ),
    Kind.MEMORY: _COMMON
    + (
        Col("allocated_bytes", "i8"),   # device allocated (GPU); -1 on CPU
        Col("reserved_bytes", "i8"),
        Col("peak_bytes", "i8"),
        Col("rss_bytes", "i8"),         # process resident set
        Col("budget_bytes", "i8"),      # declared budget, -1 if none
    ),
    Kind.THROUGHPUT: _COMMON
    + (
        Col("tokens_per_s", "f8"),
        Col("samples_per_s", "f8"),
        Col("tflops", "f8"),            # achieved TFLOP/s on this rank; NaN without declared FLOPs
        Col("mfu", "f8"),               # achieved / peak; NaN without both
    ),
    Kind.GPU_SAMPLE: _COMMON
    + (
        Col("node", "str"),
        Col("gpu", "i4"),
        Col("uuid", "str"),
        Col("util_pct", "f8"),
        Col("mem_util_pct", "f8"),
        Col("mem_used_bytes", "f8"),
        Col("mem_total_bytes", "f8"),
        Col("power_mw", "f8"),
        Col("energy_mj", "f8"),
        Col("temp_c", "f8"),
        Col("sm_clock_mhz", "f8"),
        Col("clock_event_reasons", "f8"),  # bitmask (exact below 2**53)
        Col("pcie_tx_bytes", "f8"),        # cumulative counter
        Col("pcie_rx_bytes", "f8"),
        Col("nvlink_tx_bytes", "f8"),      # cumulative counter
        Col("nvlink_rx_bytes", "f8"),
        Col("ecc_uncorrected", "f8"),
        Col("remapped_rows", "f8"),
        # schema 3: appended (a file migrates with ALTER TABLE ... ADD COLUMN): hardware risk's inputs
        Col("ecc_corrected", "f8"),        # volatile corrected ECC errors, since the driver loaded
        Col("remap_pending", "f8"),        # 1: a row remap waits for a GPU reset (NVML gives a flag, not a count)
        Col("remap_failure", "f8"),        # 1: a row remapping failed
        Col("pcie_replays", "f8"),         # cumulative PCIe replay counter
        Col("pcie_correctable", "f8"),     # cumulative PCIe correctable errors
        Col("temp_slowdown_c", "f8"),      # the GPU's slowdown temperature (thermal margin = this - temp_c)
        Col("power_limit_mw", "f8"),       # enforced power limit
    ),
    Kind.HOST_SAMPLE: _COMMON
    + (
        Col("node", "str"),
        Col("cpu_pct", "f8"),
        Col("mem_used_bytes", "f8"),
        Col("mem_total_bytes", "f8"),
        Col("net_rx_bytes_per_s", "f8"),
        Col("net_tx_bytes_per_s", "f8"),
        Col("disk_read_bytes_per_s", "f8"),
        Col("disk_write_bytes_per_s", "f8"),
    ),
    Kind.HEARTBEAT: _COMMON
    + (
        Col("phase", "str"),            # idle | data | forward | backward | optimizer | comm | closed (the last, at a clean close)
        Col("pending_op", "str"),       # the collective this rank is inside of, "" if none
        Col("pending_role", "str"),
        Col("pending_since_ns", "i8"),  # wall clock it entered it, -1 if none
        Col("hostname", "str"),
        Col("pid", "i4"),
    ),
    Kind.GAP: _COMMON
    + (
        Col("kind", "str"),             # the event kind (or "batch") that was dropped
        Col("dropped", "i8"),           # rows (or batches) lost
        Col("reason", "str"),           # see tracetop/wire/ledger.py: queue_full | bad_row | unacked_full | rejected:<fault> | spool_unreadable
        Col("origin_source", "str"),    # the source whose data was lost
    ),
    Kind.XID: _COMMON
    + (
        Col("node", "str"),
        Col("gpu", "i4"),
        Col("xid", "i8"),
        Col("description", "str"),
    ),
    Kind.CLOCK_OFFSET: _COMMON
    + (
        Col("node", "str"),
        Col("offset_ns", "i8"),         # collector clock minus node clock
        Col("rtt_ns", "i8"),
    ),
    Kind.GPU_PROCESS: _COMMON
    + (
        Col("node", "str"),
        Col("gpu", "i4"),
        Col("pid", "i4"),
        Col("used_bytes", "i8"),
    ),
}

#: numpy dtype strings for the numeric wire dtypes (always little-endian).
NUMPY_DTYPES = {"i4": "<i4", "i8": "<i8", "f8": "<f8", "str": "<i4"}


def table_name(kind: Kind) -> str:
    """The DuckDB table (and the name users see) for an event kind."""
    return kind.name.lower()


#: Columns appended to a kind by each schema version after OLDEST_READ_SCHEMA (in order, at the end).
APPENDED_IN: dict[int, dict[Kind, tuple[str, ...]]] = {
    3: {Kind.GPU_SAMPLE: ("ecc_corrected", "remap_pending", "remap_failure", "pcie_replays",
                          "pcie_correctable", "temp_slowdown_c", "power_limit_mw")},
}


def columns_of(kind: Kind, version: int) -> tuple[Col, ...]:
    """The columns a batch of `kind` has at schema `version` (OLDEST_READ_SCHEMA..SCHEMA_VERSION)."""
    later = {name for v, kinds in APPENDED_IN.items() if v > version for name in kinds.get(kind, ())}
    return tuple(c for c in SCHEMAS[kind] if c.name not in later)


for _v, _kinds in APPENDED_IN.items():  # appended columns are floats at the end: NaN fills them
    for _kind, _names in _kinds.items():
        _tail = SCHEMAS[_kind][-len(_names):]
        assert [c.name for c in _tail] == list(_names) and all(c.dtype == "f8" for c in _tail), (_v, _kind)
