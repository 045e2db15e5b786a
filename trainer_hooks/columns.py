"""Compact hot-path rows -> the wire's columns, vectorised (pure functions, run on the emitter).

The training thread extends plain lists with each row's numbers (collectives, instructions: flat,
``ROW_WIDTH`` a row) or appends a tuple (steps); every string a row would
carry (op, role, dtype, instruction) is replaced by the index of a small "signature" it already
looked up. The emitter turns a whole list into numpy columns at once, strings as ready
``(codes, dictionary)`` pairs, and hands them to ``Shipper.record_many``. Per row that is a few
C-level conversions instead of the shipper's per-row transposition and string sorting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _codes(values: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    index: dict[str, int] = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values), "<i4", len(values))
    return codes, list(index)


def _string_column(per_sig: Sequence[str], sig: np.ndarray) -> tuple[np.ndarray, list[str]]:
    codes, dictionary = _codes(per_sig)
    return codes[sig], dictionary


#: numbers per row in the flat buffers (``Recorder.collective_rows``, ``Recorder.instr_rows``)
ROW_WIDTH = 5


def _flat_columns(rows: Sequence[int]) -> tuple[int, list[np.ndarray]]:
    """(rows, the ROW_WIDTH columns) of a flat buffer, each column contiguous."""
    table = np.array(rows, "<i8").reshape(-1, ROW_WIDTH)
    return len(table), [np.ascontiguousarray(table[:, i]) for i in range(ROW_WIDTH)]


def collective_columns(rank: int, rows: Sequence[int], sigs: Sequence[tuple]) -> dict[str, Any]:
    """rows: flat, step, start_ns, duration_ns, bytes, sig a row; sigs[sig]: (op, role, group_size, peer, dtype, is_async)."""
    n, (step, start, dur, nbytes, sig) = _flat_columns(rows)
    sig = sig.astype(np.intp)
    ops, roles, sizes, peers, dtypes, asyncs = zip(*sigs)
    return {
        "rank": np.full(n, rank, "<i4"), "step": step, "start_ns": start, "duration_ns": dur,
        "op": _string_column(ops, sig), "role": _string_column(roles, sig),
        "group_size": np.array(sizes, "<i4")[sig], "bytes": nbytes, "peer": np.array(peers, "<i4")[sig],
        "dtype": _string_column(dtypes, sig), "is_async": np.array(asyncs, "<i4")[sig],
    }


def instr_columns(rank: int, stage: int, rows: Sequence[int], names: Sequence[str]) -> dict[str, Any]:
    """rows: flat, step, start_ns, duration_ns, micro_batch, instr code a row; names[code] = instruction."""
    n, (step, start, dur, mb, code) = _flat_columns(rows)
    return {
        "rank": np.full(n, rank, "<i4"), "step": step, "start_ns": start, "duration_ns": dur,
        "stage": np.full(n, stage, "<i4"), "micro_batch": mb.astype("<i4"),
        "instr": (code.astype("<i4"), list(names)),
    }


#: one tuple per step, as the training thread appends it (the least work there): the step's own
#: figures, the loss and batch shape in force, the step's memory peak (-1: not measured) and the
#: index of the MFU inputs in force (``Recorder.mfu_table``: flops_per_token, model_share, peak_flops)
STEP_ROW = ("step", "start_ns", "duration_ns", "data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns",
            "comm_exposed_ns", "tokens", "samples", "loss", "micro_batch", "micro_batches", "step_peak_bytes",
            "mfu_index")
_FLOATS = {"loss"}


def step_columns(rank: int, rows: Sequence[tuple], memory: tuple[int, int, int, int, int],
                 mfu_table: Sequence[tuple[float, float, float]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """STEP, THROUGHPUT and MEMORY columns of ``rows`` (``STEP_ROW`` tuples). ``memory``: the
    emitter's sample (allocated, reserved, peak, rss, budget bytes); a row's own peak, where
    measured, replaces the sample's (a step whose peak was not read says -1). Throughput and MFU as the training thread once computed them
    per row (the same float operations, in the same order, elementwise)."""
    n = len(rows)
    c = {name: np.array(col, "<f8" if name in _FLOATS else "<i8") for name, col in zip(STEP_ROW, zip(*rows))}
    flops_per_token, model_share, peak_flops = np.array(mfu_table, "<f8")[c["mfu_index"]].T
    dur, tokens, samples = c["duration_ns"], c["tokens"], c["samples"]
    with np.errstate(divide="ignore", invalid="ignore"):
        secs = np.where(dur > 0, dur / 1e9, np.nan)
        tps = np.where(tokens >= 0, tokens / secs, np.nan)
        sps = np.where(samples >= 0, samples / secs, np.nan)
        tflops = tps * flops_per_token * model_share / 1e12
        mfu = tflops * 1e12 / peak_flops
    r = np.full(n, rank, "<i4")
    common = {"rank": r, "step": c["step"], "start_ns": c["start_ns"], "duration_ns": dur}
    step = {**common, **{k: c[k] for k in ("data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns",
                                           "comm_exposed_ns")},
            "compute_ns": c["forward_ns"] + c["backward_ns"] + c["optimizer_ns"], "tokens": tokens, "samples": samples,
            "loss": c["loss"], "micro_batch": c["micro_batch"].astype("<i4"),
            "micro_batches": c["micro_batches"].astype("<i4")}
    throughput = {**common, "tokens_per_s": tps, "samples_per_s": sps, "tflops": tflops, "mfu": mfu}
    allocated, reserved, peak, rss, budget = memory
    own = c["step_peak_bytes"]
    memory_cols = {"rank": r, "step": c["step"], "start_ns": c["start_ns"] + dur, "duration_ns": np.zeros(n, "<i8"),
                   "allocated_bytes": np.full(n, allocated, "<i8"), "reserved_bytes": np.full(n, reserved, "<i8"),
                   # -1: no step peak here, the sample's; -2 (memory.SKIPPED): not read this step, -1
                   "peak_bytes": np.where(own >= 0, own, np.where(own == -1, peak, -1)), "rss_bytes": np.full(n, rss, "<i8"),
                   "budget_bytes": np.full(n, budget, "<i8")}
    return step, throughput, memory_cols
