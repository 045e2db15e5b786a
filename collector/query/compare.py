"""`tracetop compare A B [--json] [--fail-if step_time_pct>5 ...]`: two runs side by side.

A and B are each a collector's DuckDB file, or ``FILE:RUN`` (default: the file's latest run). The
figures (`profile`: aggregate SQL over one run) are medians over the step rows after the first:
step time and each phase, throughput and MFU, the memory peak, GPU-hours lost (the `lost_time`
view), fault alerts fired, and per (op, role, size) collective latency and bus bandwidth, per
stage the pipeline bubble. `diff` (pure) pairs them: B - A and the change in percent of A.

``--fail-if NAME>X`` / ``NAME<X`` (repeatable): exit 1 when the change passes X, naming what
regressed. NAME is a headline figure (HEADLINE) for the change B - A in its unit, or NAME_pct for
the change in percent of A: ``step_time_pct>5`` (B's step is over 5% slower), ``tokens_per_s_pct<-5``
(5% less throughput), ``fault_alerts>0`` (B raised a fault alert A did not).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
from dataclasses import dataclass

from tracetop.errors import TracetopError

#: headline figures: name -> (unit, SQL over the run's step rows after the first, or "" if computed apart)
HEADLINE: dict[str, tuple[str, str]] = {
    "step_time": ("ms", "median(duration_ns) / 1e6"),
    "data": ("ms", "median(data_wait_ns) / 1e6"),
    "forward": ("ms", "median(forward_ns) / 1e6"),
    "backward": ("ms", "median(backward_ns) / 1e6"),
    "optimizer": ("ms", "median(optimizer_ns) / 1e6"),
    "comm_exposed": ("ms", "median(comm_exposed_ns) / 1e6"),
    "tokens_per_s": ("tokens/s", ""),
    "samples_per_s": ("samples/s", ""),
    "mfu": ("", ""),
    "memory_peak": ("MiB", ""),
    "lost_gpu_h": ("GPU-h", ""),
    "fault_alerts": ("", ""),
}


class CompareError(TracetopError, ValueError):
    """A bad run reference or --fail-if condition: the message says what was expected."""


@dataclass(frozen=True)
class Profile:
    source: str                              # FILE:RUN
    headline: dict[str, float]               # HEADLINE names -> value (NaN: not in this run)
    collectives: dict[tuple, tuple]          # (op, role, size bytes) -> (calls, median ms, median busbw GB/s)
    bubble: dict[int, float]                 # stage -> mean measured bubble


@dataclass(frozen=True)
class Condition:
    name: str        # a HEADLINE name
    pct: bool        # compare the change in percent of A
    op: str          # ">" | "<"
    limit: float

    def text(self) -> str:
        return f"{self.name}{'_pct' if self.pct else ''}{self.op}{self.limit:g}"


def parse_condition(text: str) -> Condition:
    """``step_time_pct>5`` -> Condition("step_time", True, ">", 5.0); an unknown name says the nearest."""
    m = re.fullmatch(r"\s*([a-z_]+?)(_pct)?\s*([<>])\s*(-?[0-9.]+)\s*", text)
    if not m:
        raise CompareError(f"--fail-if {text!r}: expected NAME>X or NAME<X, e.g. step_time_pct>5 or fault_alerts>0")
    name, pct, op, limit = m.group(1), bool(m.group(2)), m.group(3), m.group(4)
    if name not in HEADLINE:
        near = difflib.get_close_matches(name, list(HEADLINE), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise CompareError(f"--fail-if {text!r}: {name!r} is not a figure{hint}; one of {', '.join(HEADLINE)}, "
                           f"each also as NAME_pct (the change in percent of A)")
    try:
        value = float(limit)
    except ValueError:
        raise CompareError(f"--fail-if {text!r}: {limit!r} is not a number") from None
    return Condition(name, pct, op, value)


# ----------------------------------------------------------------------------- gathering (SQL)


def split_ref(ref: str) -> tuple[str, str | None]:
    """``FILE`` or ``FILE:RUN`` (a file that exists as given wins over a split at its last colon)."""
    import os

    if os.path.exists(ref) or ":" not in ref:
        return ref, None
    path, run = ref.rsplit(":", 1)
    return path, run or None


def profile(con, run_id: str, source: str) -> Profile:
    from collector.query.post_file import has_relation
    from collector.query.verdict import gather
    from collector.report import gather_bubble, gather_collectives

    first = con.execute("SELECT coalesce(min(step), 0) FROM step WHERE run_id = ?", [run_id]).fetchone()[0]
    sql_cols = [(k, q) for k, (_, q) in HEADLINE.items() if q]
    row = con.execute(f"SELECT {', '.join(q for _, q in sql_cols)} FROM step WHERE run_id = ? AND step > ?",
                      [run_id, first]).fetchone()
    head = {k: (float(v) if v is not None else math.nan) for (k, _), v in zip(sql_cols, row)}
    nan = math.nan
    tp = (con.execute("SELECT median(tokens_per_s), median(samples_per_s), median(mfu) FROM throughput "
                      "WHERE run_id = ? AND step > ?", [run_id, first]).fetchone() if has_relation(con, "throughput")
          else (nan, nan, nan))
    for k, v in zip(("tokens_per_s", "samples_per_s", "mfu"), tp):
        head[k] = float(v) if v is not None and v == v and v >= 0 else nan
    peak = (con.execute("SELECT max(CASE WHEN peak_bytes > 0 THEN peak_bytes WHEN allocated_bytes > 0 THEN "
                        "allocated_bytes ELSE rss_bytes END) FROM memory WHERE run_id = ?", [run_id]).fetchone()[0]
            if has_relation(con, "memory") else None)
    head["memory_peak"] = float(peak) / 2**20 if peak else nan
    facts = gather(con, run_id)
    head["lost_gpu_h"] = sum(facts.lost_gpu_ms.values()) / 3.6e6
    head["fault_alerts"] = float(len(facts.incidents))
    colls = {(op, role, int(size)): (int(n), float(ms or 0.0), float(bw or 0.0))
             for op, role, size, n, ms, bw in gather_collectives(con, run_id)}
    bubble = {int(s): float(b) for s, b, *_ in gather_bubble(con, run_id) if b is not None}
    return Profile(source, head, colls, bubble)


def open_profile(ref: str) -> Profile:
    from collector.query.post_file import PostFileError, open_read_only, pick_run

    path, run = split_ref(ref)
    try:
        con = open_read_only(path)
    except PostFileError as e:
        raise CompareError(f"{ref}: {e}") from None
    try:
        try:
            run_id = pick_run(con, run)
        except PostFileError as e:
            raise CompareError(f"{path}: {e}") from None
        return profile(con, run_id, f"{path}:{run_id}")
    finally:
        con.close()


# ----------------------------------------------------------------------------- comparing (pure)


def _change(a: float, b: float) -> tuple[float, float]:
    """(b - a, percent of a); NaN where either is missing (or a is 0 for the percent)."""
    if a != a or b != b:
        return math.nan, math.nan
    return b - a, ((b - a) / a * 100.0 if a else (0.0 if b == a else math.nan))


def diff(a: Profile, b: Profile) -> dict:
    """Every figure of A and B with B - A and the change in percent of A."""
    head = {k: {"a": a.headline.get(k, math.nan), "b": b.headline.get(k, math.nan), "unit": HEADLINE[k][0]}
            for k in HEADLINE}
    for v in head.values():
        v["delta"], v["pct"] = _change(v["a"], v["b"])
    colls = []
    for key in sorted(set(a.collectives) | set(b.collectives)):
        ca, cb = a.collectives.get(key), b.collectives.get(key)
        colls.append({"op": key[0], "role": key[1], "bytes": key[2],
                      "a_ms": ca[1] if ca else math.nan, "b_ms": cb[1] if cb else math.nan,
                      "ms_pct": _change(ca[1], cb[1])[1] if ca and cb else math.nan,
                      "a_busbw_gbps": ca[2] if ca else math.nan, "b_busbw_gbps": cb[2] if cb else math.nan})
    bubble = [{"stage": s, "a": a.bubble.get(s, math.nan), "b": b.bubble.get(s, math.nan)}
              for s in sorted(set(a.bubble) | set(b.bubble))]
    return {"a": a.source, "b": b.source, "headline": head, "collectives": colls, "bubble": bubble}


def failed(d: dict, conditions: list[Condition]) -> list[str]:
    """One line per condition B passed: what regressed, by how much."""
    out = []
    for c in conditions:
        h = d["headline"][c.name]
        got = h["pct"] if c.pct else h["delta"]
        if got != got:
            continue  # not in one of the runs: nothing to hold it against
        if (got > c.limit) if c.op == ">" else (got < c.limit):
            unit = "%" if c.pct else (f" {h['unit']}" if h["unit"] else "")
            out.append(f"{c.name}: {h['a']:.4g} -> {h['b']:.4g} {h['unit']} ({got:+.3g}{unit}; fail-if {c.text()})")
    return out


# ----------------------------------------------------------------------------- rendering


def _f(x: float, fmt: str = ".2f") -> str:
    return "-" if x != x else format(x, fmt)


def render(d: dict) -> str:
    lines = [f"A: {d['a']}", f"B: {d['b']}", ""]
    w = max(len(k) for k in HEADLINE) + 2
    lines.append(f"{'figure':<{w}}{'A':>12}{'B':>12}{'B-A':>12}{'change':>10}  unit")
    for k, h in d["headline"].items():
        pct = "-" if h["pct"] != h["pct"] else f"{h['pct']:+.1f}%"
        lines.append(f"{k:<{w}}{_f(h['a']):>12}{_f(h['b']):>12}{_f(h['delta'], '+.2f'):>12}{pct:>10}  {h['unit']}")
    if d["collectives"]:
        lines += ["", "collectives (median ms, busbw GB/s) by op, role, size"]
        for c in d["collectives"]:
            pct = "-" if c["ms_pct"] != c["ms_pct"] else f"{c['ms_pct']:+.1f}%"
            lines.append(f"  {c['op']:<24}{c['role']:<10}{c['bytes']:>10} B  {_f(c['a_ms'], '.3f'):>9} -> "
                         f"{_f(c['b_ms'], '.3f'):>9} ms {pct:>8}   busbw {_f(c['a_busbw_gbps'], '.3f')} -> "
                         f"{_f(c['b_busbw_gbps'], '.3f')}")
    if d["bubble"]:
        lines += ["", "pipeline bubble by stage"]
        lines += [f"  stage {s['stage']}: {_f(s['a'], '.3f')} -> {_f(s['b'], '.3f')}" for s in d["bubble"]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command


def add_arguments(parser) -> None:
    parser.add_argument("a", metavar="A", help="the baseline: FILE or FILE:RUN (default run: the file's latest)")
    parser.add_argument("b", metavar="B", help="the candidate: FILE or FILE:RUN")
    parser.add_argument("--json", action="store_true", help="one JSON object (NaN as null)")
    parser.add_argument("--fail-if", action="append", default=[], metavar="COND",
                        help="exit 1 if B's change passes it: step_time_pct>5, tokens_per_s_pct<-5, fault_alerts>0 "
                             f"(figures: {', '.join(HEADLINE)}; NAME_pct: in percent of A)")


def _nan_to_none(x):
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def run(args) -> int:
    try:
        conditions = [parse_condition(t) for t in args.fail_if]
        d = diff(open_profile(args.a), open_profile(args.b))
    except CompareError as e:
        print(f"tracetop compare: {e}", file=sys.stderr)
        return 2
    bad = failed(d, conditions)
    if args.json:
        print(json.dumps(_nan_to_none({**d, "failed": bad})))
    else:
        print(render(d))
        if conditions:
            print()
            print("regressed: " + "; ".join(bad) if bad else
                  f"passed: {', '.join(c.text() for c in conditions)}")
    return 1 if bad else 0
