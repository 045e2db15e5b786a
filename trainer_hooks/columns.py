"""Compact hot-path rows -> the wire's columns, vectorised (pure functions, run on the emitter).

The training thread appends short tuples of numbers to plain lists; every string a row would
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


def collective_columns(rank: int, rows: Sequence[tuple], sigs: Sequence[tuple]) -> dict[str, Any]:
    """rows: (step, start_ns, duration_ns, bytes, sig); sigs[sig]: (op, role, group_size, peer, dtype, is_async)."""
    n = len(rows)
    step, start, dur, nbytes, sig = (np.array(c, "<i8") for c in zip(*rows))
    sig = sig.astype(np.intp)
    ops, roles, sizes, peers, dtypes, asyncs = zip(*sigs)
    return {
        "rank": np.full(n, rank, "<i4"), "step": step, "start_ns": start, "duration_ns": dur,
        "op": _string_column(ops, sig), "role": _string_column(roles, sig),
        "group_size": np.array(sizes, "<i4")[sig], "bytes": nbytes, "peer": np.array(peers, "<i4")[sig],
        "dtype": _string_column(dtypes, sig), "is_async": np.array(asyncs, "<i4")[sig],
    }


def instr_columns(rank: int, stage: int, rows: Sequence[tuple], names: Sequence[str]) -> dict[str, Any]:
    """rows: (step, start_ns, duration_ns, micro_batch, instr code); names[code] = instruction."""
    n = len(rows)
    step, start, dur, mb, code = (np.array(c, "<i8") for c in zip(*rows))
    return {
        "rank": np.full(n, rank, "<i4"), "step": step, "start_ns": start, "duration_ns": dur,
        "stage": np.full(n, stage, "<i4"), "micro_batch": mb.astype("<i4"),
        "instr": (code.astype("<i4"), list(names)),
    }


#: one tuple per step, in this order, split into the STEP, THROUGHPUT and MEMORY kinds
STEP_FIELDS = ("step", "start_ns", "duration_ns", "data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns",
               "comm_exposed_ns", "compute_ns", "tokens", "samples", "tokens_per_s", "samples_per_s", "tflops",
               "mfu", "loss", "micro_batch", "micro_batches", "allocated_bytes", "reserved_bytes", "peak_bytes", "rss_bytes", "budget_bytes")
_FLOATS = {"tokens_per_s", "samples_per_s", "tflops", "mfu", "loss"}


def step_columns(rank: int, rows: Sequence[tuple]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    n = len(rows)
    c = {name: np.array(col, "<f8" if name in _FLOATS else "<i8") for name, col in zip(STEP_FIELDS, zip(*rows))}
    r = np.full(n, rank, "<i4")
    common = {"rank": r, "step": c["step"], "start_ns": c["start_ns"], "duration_ns": c["duration_ns"]}
    step = {**common, **{k: c[k] for k in ("data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns",
                                           "comm_exposed_ns", "compute_ns", "tokens", "samples", "loss")},
            "micro_batch": c["micro_batch"].astype("<i4"), "micro_batches": c["micro_batches"].astype("<i4")}
    throughput = {**common, **{k: c[k] for k in ("tokens_per_s", "samples_per_s", "tflops", "mfu")}}
    memory = {"rank": r, "step": c["step"], "start_ns": c["start_ns"] + c["duration_ns"], "duration_ns": np.zeros(n, "<i8"),
              **{k: c[k] for k in ("allocated_bytes", "reserved_bytes", "peak_bytes", "rss_bytes", "budget_bytes")}}
    return step, throughput, memory
