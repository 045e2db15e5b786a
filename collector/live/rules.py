"""Rules as data: a TOML file of `[rule.NAME]` tables, validated before anything starts.

    [rule.grad_sync]
    signal = "grad_sync"          # what it judges (SIGNALS below)
    scope = "run"                 # run | stage | rank | role | node | gpu (each signal allows some)
    grad_sync_ms_above = 200      # the comparison: its key carries the unit
    for_steps = 3                 # hold: breached on this many completed steps in a row (or for_s)
    clear_below = 150             # hysteresis: resolves once the value is back below this
    severity = "warning"          # info | warning | critical
    labels = { team = "infra" }   # copied onto the alert

`load(path)` returns the rules or raises `RulesError` holding every fault found, each with the
file, the line and the key, and what to write instead (unknown keys get the nearest valid key).
tomllib gives no line numbers for keys, so `_key_lines` finds them in the text.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import tomllib

from collector.live.lost import CostSettings
from collector.live.model import KINDS, SCOPES, SEVERITIES
from tracetop.errors import TracetopError


@dataclass(frozen=True)
class Key:
    """One comparison or parameter key of a signal. `op`: "above" / "below" (a threshold: the
    rule breaches when the value is above / below it) or "param" (a tuning figure)."""

    name: str
    op: str
    lo: float = 0.0           # smallest allowed value
    hi: float = math.inf      # largest allowed value
    lo_open: bool = False     # lo itself not allowed
    integer: bool = False
    doc: str = ""


@dataclass(frozen=True)
class SignalSpec:
    name: str
    scopes: tuple[str, ...]           # allowed scopes, the first is the default
    keys: tuple[Key, ...]             # the first "above"/"below" key is the threshold
    time_based: bool = False          # evaluated on a timer (for_s holds), not per step
    doc: str = ""

    @property
    def threshold_keys(self) -> tuple[Key, ...]:
        return tuple(k for k in self.keys if k.op in ("above", "below"))

    def key(self, name: str) -> Key | None:
        return next((k for k in self.keys if k.name == name), None)


_INF = math.inf
SIGNALS: dict[str, SignalSpec] = {s.name: s for s in (
    SignalSpec("straggler", ("rank",), (
        Key("excess_ms_above", "above", doc="compute beyond the stage's other ranks' median, ms"),
        Key("compute_ratio_above", "param", lo=1.0, lo_open=True, doc="compute / the others' median"),
        Key("z_above", "param", lo=0.0, lo_open=True, doc="robust z-score of compute, with 5+ ranks a stage"),
    ), doc="per step: computes longest (excess, ratio, z) and waits less than the others of its stage"),
    SignalSpec("data_stall", ("rank",), (
        Key("excess_ms_above", "above", doc="data wait beyond the stage's other ranks' median, ms"),
        Key("data_ratio_above", "param", lo=1.0, lo_open=True, doc="data wait / the others' median"),
        Key("z_above", "param", lo=0.0, lo_open=True, doc="robust z-score of data wait, with 5+ ranks a stage"),
    ), doc="per step: waits longest for its data loader (STEP.data_wait_ns) and less than the others in "
           "collectives (they wait for it): cause data, not the network"),
    SignalSpec("silent_rank", ("rank",), (
        Key("silent_s_above", "above", lo=0.0, lo_open=True, doc="seconds since the rank's last heartbeat"),
    ), time_based=True, doc="no heartbeat past a deadline"),
    SignalSpec("first_failure", ("rank",), (
        Key("silent_s_above", "above", lo=0.0, lo_open=True,
            doc="the run stopped: every rank closed, or silent this long; then the first to go is named"),
    ), time_based=True, doc="when a run's ranks fall silent or end uncleanly, the rank that went first (a rank "
                            "never heard, else the earliest last heard of those without a clean close), once"),
    SignalSpec("unheard_rank", ("rank",), (
        Key("unheard_s_above", "above", lo=0.0, lo_open=True,
            doc="seconds since the run's first row with a rank of its world size not heard from"),
    ), time_based=True, doc="a rank of the run's world size (RUN_START) never heard from while its peers are"),
    SignalSpec("stuck_collective", ("rank",), (
        Key("stuck_s_above", "above", lo=0.0, lo_open=True, doc="seconds inside one collective"),
    ), time_based=True, doc="stuck in one collective while the others moved on; the blocked ranks named as waiting"),
    SignalSpec("grad_sync", ("run",), (
        Key("grad_sync_ms_above", "above", doc="p99 across ranks of the step's DP gradient reductions, ms"),
    ), doc="time per step in data-parallel gradient reductions (not the 4-byte loss/overflow all-reduces)"),
    SignalSpec("grad_sync_scaling", ("run",), (
        Key("sqrt_k_ratio_above", "above", lo=0.0, lo_open=True,
            doc="grad-sync p50 / (sqrt(k) x the baseline's), k = DP size / the baseline's"),
        Key("baseline_floor_ms", "param", doc="the baseline's grad-sync is taken as at least this (a DP1 baseline has none)"),
    ), doc="the seed's scaling rule: DP k-times larger, grad-sync below sqrt(k) x the baseline's"),
    SignalSpec("comm_share", ("run", "rank"), (
        Key("comm_share_above", "above", hi=1.0, doc="exposed communication / step time"),
    )),
    SignalSpec("bubble", ("stage",), (
        Key("waiting_share_above", "above", hi=1.0,
            doc="share of the stage's step time spent waiting on its neighbour stage"),
        Key("imbalance_above", "param", lo=1.0, doc="names the slow stage when slowest/fastest compute is above this"),
    ), doc="pipeline bubble; acts on the waiting share of its time budget, not framework overhead"),
    SignalSpec("stage_imbalance", ("run",), (
        Key("imbalance_above", "above", lo=1.0, doc="slowest stage's compute / fastest's"),
    )),
    SignalSpec("scaling_efficiency", ("run",), (
        Key("efficiency_below", "below", hi=1.0, lo_open=True,
            doc="per-rank throughput / the baseline's (--baseline RUN_ID, or per_rank_tokens_per_s)"),
        Key("per_rank_tokens_per_s", "param", lo=0.0, lo_open=True, doc="a declared per-rank baseline"),
    )),
    SignalSpec("memory", ("rank",), (
        Key("used_of_budget_above", "above", hi=1.0, lo_open=True,
            doc="used / budget (the hooks' budget, else the GPU's total, else budget_mb)"),
        Key("budget_mb", "param", lo_open=True, doc="a declared per-rank budget where the hooks give none"),
    )),
    SignalSpec("offload_bandwidth", ("rank",), (
        Key("offload_gbps_below", "below", lo_open=True, doc="GB/s over copy time, per direction"),
    )),
    SignalSpec("loss_spike", ("run",), (
        Key("spike_share_above", "above", lo_open=True, doc="(loss - rolling median) / rolling median"),
        Key("window_steps", "param", lo=2, integer=True, doc="the rolling median's window"),
    )),
    SignalSpec("throughput_per_gpu", ("rank",), (
        Key("tokens_per_s_below", "below", lo_open=True, doc="a declared per-GPU SLA (off unless declared)"),
    )),
    SignalSpec("xid", ("gpu", "node"), (
        Key("xid_count_above", "above", doc="XID events seen"),
    ), time_based=True),
    SignalSpec("thermal_throttle", ("gpu",), (
        Key("throttled_share_above", "above", hi=1.0, doc="1 while the GPU reports thermal/power throttling"),
    ), time_based=True),
    SignalSpec("ecc", ("gpu",), (
        Key("ecc_errors_above", "above", doc="uncorrected ECC errors"),
    ), time_based=True),
    SignalSpec("collector_behind", ("collector",), (
        Key("behind_s_above", "above", doc="seconds the collector has been behind without a break: a stream held "
                                           "by backpressure, or its oldest batch not yet committed waiting over 2 s"),
    ), time_based=True, doc="the collector itself cannot keep up with what it is offered; the alert says how far "
                            "behind (the oldest batch's wait, streams held, rows the shippers counted as not stored)"),
    # the seed dashboard's judgments (collector/query/dashboard.py), live: evaluated every `every_s`
    # on the engine's thread, outside its lock, by the dashboard's SQL over the last `window_s` of rows
    SignalSpec("cross_node_share", ("role",), (
        Key("cross_share_above", "above", hi=1.0,
            doc="share of a DP/TP group's communication time on cross-node links (comm_cross_share)"),
        Key("every_s", "param", lo=1.0, doc="seconds between evaluations (each one is an SQL query)"),
        Key("window_s", "param", lo=1.0, doc="seconds of collective rows judged, up to the newest"),
    ), time_based=True, doc="a DP/TP group whose communication runs mostly between nodes (the seed's "
                            "\"cross-rack traffic exceeds 60%\"), the group named"),
    SignalSpec("hardware_risk", ("gpu",), (
        Key("risk_points_above", "above", doc="the hardware_risk view's points; 4 or more is 'likely to fail'"),
        Key("every_s", "param", lo=1.0, doc="seconds between evaluations (each one is an SQL query)"),
        Key("window_s", "param", lo=1.0, doc="seconds of the GPU's samples judged, up to the newest"),
    ), time_based=True, doc="a GPU likely to fail, ahead of the failure, with the evidence (hardware_risk)"),
    SignalSpec("fragmentation", ("rank",), (
        Key("frag_rise_per_100_steps_above", "above", lo=0.0,
            doc="the allocator's (reserved - allocated) / reserved, its rise per 100 steps"),
        Key("frag_share_above", "param", lo=0.0, hi=1.0, doc="... and the latest share above this"),
        Key("every_s", "param", lo=1.0, doc="seconds between evaluations (each one is an SQL query)"),
        Key("window_s", "param", lo=1.0, doc="seconds of memory rows judged, up to the newest"),
    ), time_based=True, doc="a rank's device-memory fragmentation rising (fragmentation_trend; GPU runs only)"),
)}
#: the signals judged by the dashboard's SQL on a slow cadence (engine.py, LiveEngine), not by the
#: evaluator's tick; their defaults: (every_s, window_s)
DASHBOARD_SIGNALS = {"cross_node_share": (60.0, 30.0), "hardware_risk": (300.0, 12 * 3600.0),
                     "fragmentation": (60.0, 120.0)}

#: keys every rule may have besides its signal's
COMMON_KEYS = ("signal", "scope", "for_steps", "for_s", "clear_below", "clear_above", "keep_firing_steps",
               "keep_firing_s", "severity", "labels", "enabled", "description", "kind")
#: What each signal's alerts are unless a rule says `kind = "..."`: a fault opens an incident that
#: names the culprit and the cause; an SLA breach is a figure past its objective (a consequence of
#: an incident where one explains it); hardware is the GPU's own report.
DEFAULT_KIND = {
    "straggler": "fault", "data_stall": "fault", "silent_rank": "fault", "first_failure": "fault",
    "unheard_rank": "fault", "stuck_collective": "fault", "memory": "fault", "loss_spike": "fault",
    "grad_sync": "sla", "grad_sync_scaling": "sla", "comm_share": "sla", "bubble": "sla", "stage_imbalance": "sla",
    "scaling_efficiency": "sla", "throughput_per_gpu": "sla", "offload_bandwidth": "sla",
    "xid": "hardware", "thermal_throttle": "hardware", "ecc": "hardware", "hardware_risk": "hardware",
    "cross_node_share": "sla", "fragmentation": "sla", "collector_behind": "sla",
}
#: a firing step rule keeps firing through this many cleared steps (Prometheus' keep_firing_for): a
#: breach again within them is the same alert, not a new one (the demo's memory pressure fired and
#: resolved 15 times in 60 steps); timer rules resolve at once unless keep_firing_s says otherwise
KEEP_FIRING_STEPS = 10


@dataclass(frozen=True)
class Rule:
    name: str
    signal: str
    scope: str
    threshold_key: str
    threshold: float
    op: str                                  # "above" | "below"
    params: Mapping[str, float] = field(default_factory=dict)
    for_steps: int = 1
    for_s: float = 0.0
    clear: float | None = None               # clear_below (op above) / clear_above (op below)
    keep_firing: float = 0.0                 # the resolve hold: cleared steps (step rules) or seconds (timer)
    severity: str = "warning"
    labels: Mapping[str, str] = field(default_factory=dict)
    enabled: bool = True
    line: int = 0
    kind: str = ""                           # fault | sla | hardware ("" = the signal's, DEFAULT_KIND)

    @property
    def alert_kind(self) -> str:
        return self.kind or DEFAULT_KIND.get(self.signal, "fault")

    def breached(self, value: float) -> bool:
        if value != value:  # NaN: unknown, never a breach
            return False
        return value > self.threshold if self.op == "above" else value < self.threshold

    def cleared(self, value: float) -> bool:
        """Back to normal: past the hysteresis limit where one is set, else no longer breached."""
        if value != value:
            return True
        if self.op == "above":
            return value < self.clear if self.clear is not None else value <= self.threshold
        return value > self.clear if self.clear is not None else value >= self.threshold


@dataclass(frozen=True)
class Fault:
    line: int
    key: str
    message: str


class RulesError(TracetopError, ValueError):
    """A rules file that cannot be used. `faults`: every one found, each with line and key."""

    def __init__(self, path: str, faults: list[Fault]) -> None:
        self.path = path
        self.faults = faults
        super().__init__("\n".join(f"{path}:{f.line}: {f.key}: {f.message}" if f.key else f"{path}:{f.line}: {f.message}"
                                   for f in faults))


_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+|\"[^\"]*\")\s*=")


def _key_lines(text: str) -> tuple[dict[tuple[str, ...], int], dict[tuple[tuple[str, ...], str], int]]:
    """(table path -> header line, (table path, key) -> line), 1-based, from the raw text."""
    headers: dict[tuple[str, ...], int] = {}
    keys: dict[tuple[tuple[str, ...], str], int] = {}
    table: tuple[str, ...] = ()
    for i, line in enumerate(text.splitlines(), 1):
        m = _HEADER.match(line)
        if m:
            table = tuple(p.strip().strip('"') for p in m.group(1).split("."))
            headers.setdefault(table, i)
            continue
        m = _KEY.match(line)
        if m:
            keys.setdefault((table, m.group(1).strip('"')), i)
    return headers, keys


def _nearest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(options)}"


def _unit_of(key: str) -> tuple[str, str]:
    """('grad_sync', 'ms') for 'grad_sync_ms_above'; ('', '') when the key has no unit part."""
    m = re.match(r"^(.*)_(ms|s|us|ns|min|gbps|mbps|gb|mb|share|pct|percent|ratio|count|errors|tokens_per_s)_(above|below)$", key)
    return (m.group(1), m.group(2)) if m else ("", "")


def parse(text: str, path: str = "<rules>") -> list[Rule]:
    """Validate a rules file's text; raises RulesError with every fault (its [cost] table too)."""
    return parse_all(text, path)[0]


def parse_cost(text: str, path: str = "<rules>") -> CostSettings:
    """The file's [cost] table (the built-in settings where it has none); raises RulesError with
    every fault of the whole file."""
    return parse_all(text, path)[1]


#: [cost] keys: (doc, lo, hi, lo_open); currency is a string
COST_KEYS: dict[str, tuple[str, float, float, bool]] = {
    "price_per_gpu_hour": ("what one GPU-hour costs, in `currency`: lost GPU-hours are shown as money", 0.0, _INF, True),
    "comm_baseline_share": ("exposed communication up to this share of the what-if step time is not counted as lost",
                            0.0, 1.0, False),
    "window_s": ("seconds of step time the 'last N minutes' gauges and the TUI line cover", 0.0, 7 * 86400.0, True),
}
COST_STR_KEYS = ("currency",)


def _parse_cost(body: object, key_lines: dict, hline: int, faults: list[Fault]) -> CostSettings:
    if not isinstance(body, dict):
        faults.append(Fault(hline, "cost", "must be a table: [cost]"))
        return CostSettings()
    valid = list(COST_KEYS) + list(COST_STR_KEYS)
    got: dict[str, object] = {}
    for key, value in body.items():
        line = key_lines.get((("cost",), key), hline)
        if key in COST_STR_KEYS:
            if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z$\u20ac\u00a3\u00a5]{1,8}", value):
                faults.append(Fault(line, key, f"must be a short currency name like \"USD\" or \"EUR\" (1-8 letters), "
                                               f"got {value!r}"))
                continue
            got[key] = value
            continue
        spec = COST_KEYS.get(key)
        if spec is None:
            faults.append(Fault(line, key, f"unknown key in [cost]{_nearest(key, valid)}"))
            continue
        doc, lo, hi, lo_open = spec
        if not _number(value):
            faults.append(Fault(line, key, f"must be a number ({doc}), got {type(value).__name__} {value!r}"))
            continue
        v = float(value)
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
            rng = (f"> {lo:g}" if lo_open else f">= {lo:g}") + (f" and <= {hi:g}" if hi != _INF else "")
            faults.append(Fault(line, key, f"{value!r} is out of range: must be {rng} ({doc})"))
            continue
        got[key] = v
    return CostSettings(**got)  # type: ignore[arg-type]


def parse_all(text: str, path: str = "<rules>") -> tuple[list[Rule], CostSettings]:
    """Validate a rules file's text: its rules and its [cost] table; raises RulesError with every fault."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        raise RulesError(path, [Fault(int(m.group(1)) if m else 1, "", f"malformed TOML: {e}; fix the syntax "
                                      "(key = value lines under [rule.NAME] tables)")]) from None
    headers, key_lines = _key_lines(text)
    faults: list[Fault] = []
    rules: list[Rule] = []
    cost = CostSettings()
    for top in doc:
        if top == "cost":
            cost = _parse_cost(doc[top], key_lines, headers.get(("cost",), key_lines.get(((), top), 1)), faults)
        elif top != "rule":
            line = headers.get((top,), key_lines.get(((), top), 1))
            faults.append(Fault(line, top, f"unknown top-level key{_nearest(top, ['rule', 'cost'])} (rules are "
                                           "[rule.NAME] tables, the price and baselines of lost time a [cost] table)"))
    table = doc.get("rule", {})
    if not isinstance(table, dict):
        faults.append(Fault(key_lines.get(((), "rule"), 1), "rule", "must be tables: [rule.NAME]"))
        table = {}
    for name, body in table.items():
        hline = headers.get(("rule", name), 1)
        if not isinstance(body, dict):
            faults.append(Fault(key_lines.get((("rule",), name), hline), name, "a rule is a table: [rule.NAME]"))
            continue

        def line_of(key: str, name: str = name, hline: int = hline) -> int:
            return key_lines.get((("rule", name), key), hline)

        rule = _parse_rule(name, body, line_of, hline, faults)
        if rule is not None:
            rules.append(rule)
    if faults:
        raise RulesError(path, sorted(faults, key=lambda f: f.line))
    return rules, cost


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parse_rule(name: str, body: dict, line_of, hline: int, faults: list[Fault]) -> Rule | None:
    n0 = len(faults)
    signal = body.get("signal")
    if signal is None:
        faults.append(Fault(hline, "signal", f"rule '{name}' names no signal; add signal = \"...\" "
                                             f"(one of {', '.join(SIGNALS)})"))
        return None
    if not isinstance(signal, str) or signal not in SIGNALS:
        faults.append(Fault(line_of("signal"), "signal", f"unknown signal {signal!r}"
                            + _nearest(str(signal), list(SIGNALS)).replace("valid keys", "signals")))
        return None
    spec = SIGNALS[signal]
    valid = list(COMMON_KEYS) + [k.name for k in spec.keys]
    thresholds: list[tuple[Key, float]] = []
    params: dict[str, float] = {}
    for key, value in body.items():
        line = line_of(key)
        k = spec.key(key)
        if key in COMMON_KEYS:
            continue
        if k is None:
            stem, unit = _unit_of(key)
            match = next((t for t in spec.threshold_keys if _unit_of(t.name)[0] == stem and stem), None)
            if match is not None and unit:
                faults.append(Fault(line, key, f"wrong unit '{unit}' for signal '{signal}': its threshold is "
                                               f"'{match.name}' ({match.doc}); convert the value and use that key"))
            else:
                faults.append(Fault(line, key, f"unknown key for signal '{signal}'{_nearest(key, valid)}"))
            continue
        if not _number(value):
            faults.append(Fault(line, key, f"must be a number ({k.doc}), got {type(value).__name__} {value!r}"))
            continue
        v = float(value)
        if k.integer and not float(v).is_integer():
            faults.append(Fault(line, key, f"must be a whole number, got {value!r}"))
            continue
        if v < k.lo or (k.lo_open and v == k.lo) or v > k.hi:
            lo = f"> {k.lo:g}" if k.lo_open else f">= {k.lo:g}"
            hi = f" and <= {k.hi:g}" if k.hi != _INF else ""
            faults.append(Fault(line, key, f"{value!r} is out of range: must be {lo}{hi} ({k.doc})"))
            continue
        if k.op == "param":
            params[key] = v
        else:
            thresholds.append((k, v))
    key_faults = len(faults) > n0
    if not thresholds and not key_faults:
        want = " or ".join(k.name for k in spec.threshold_keys)
        faults.append(Fault(hline, "", f"rule '{name}' has no threshold; add {want} = VALUE"))
    if len(thresholds) > 1:
        faults.append(Fault(line_of(thresholds[1][0].name), thresholds[1][0].name,
                            f"rule '{name}' has two thresholds; give one (a rule per threshold)"))
    tkey, threshold = thresholds[0] if thresholds else (spec.threshold_keys[0], 0.0)
    scope = body.get("scope", spec.scopes[0])
    if not isinstance(scope, str) or scope not in SCOPES:
        faults.append(Fault(line_of("scope"), "scope", f"unknown scope {scope!r}{_nearest(str(scope), list(SCOPES))}"))
    elif scope not in spec.scopes:
        faults.append(Fault(line_of("scope"), "scope", f"signal '{signal}' is judged per {' or '.join(spec.scopes)}, "
                                                       f"not per {scope}; use scope = \"{spec.scopes[0]}\""))
    severity = body.get("severity", "warning")
    if not isinstance(severity, str) or severity not in SEVERITIES:
        faults.append(Fault(line_of("severity"), "severity",
                            f"{severity!r} is not a severity{_nearest(str(severity), list(SEVERITIES))}"))
    for_steps, for_s = body.get("for_steps"), body.get("for_s")
    if for_steps is not None and (not isinstance(for_steps, int) or isinstance(for_steps, bool) or for_steps <= 0):
        faults.append(Fault(line_of("for_steps"), "for_steps", f"the hold must be a positive whole number of steps, "
                                                               f"got {for_steps!r}"))
    if for_s is not None and (not _number(for_s) or for_s <= 0):
        faults.append(Fault(line_of("for_s"), "for_s", f"the hold must be a positive number of seconds, got {for_s!r}"))
    if for_steps is not None and for_s is not None:
        faults.append(Fault(line_of("for_s"), "for_s", "give one hold: for_steps or for_s"))
    if spec.time_based and for_steps is not None:
        faults.append(Fault(line_of("for_steps"), "for_steps", f"signal '{signal}' is judged on a timer, not per "
                                                               "step; hold it with for_s"))
    keep_key, wrong_keep = ("keep_firing_s", "keep_firing_steps") if spec.time_based else ("keep_firing_steps", "keep_firing_s")
    keep = body.get(keep_key, 0.0 if spec.time_based else KEEP_FIRING_STEPS)
    if wrong_keep in body:
        faults.append(Fault(line_of(wrong_keep), wrong_keep, f"signal '{signal}' is judged "
                            f"{'on a timer' if spec.time_based else 'per step'}; its resolve hold is {keep_key}"))
    elif spec.time_based and (not _number(keep) or keep < 0):
        faults.append(Fault(line_of(keep_key), keep_key, f"the resolve hold must be 0 or more seconds, got {keep!r}"))
    elif not spec.time_based and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 0):
        faults.append(Fault(line_of(keep_key), keep_key, f"the resolve hold must be a whole number of steps, 0 or "
                                                         f"more, got {keep!r}"))
    clear_key = "clear_below" if tkey.op == "above" else "clear_above"
    wrong_clear = "clear_above" if tkey.op == "above" else "clear_below"
    if wrong_clear in body:
        faults.append(Fault(line_of(wrong_clear), wrong_clear, f"'{tkey.name}' breaches {tkey.op} its threshold; its "
                                                               f"hysteresis is {clear_key}"))
    clear = body.get(clear_key)
    if clear is not None:
        if not _number(clear):
            faults.append(Fault(line_of(clear_key), clear_key, f"must be a number, got {clear!r}"))
        elif thresholds and ((tkey.op == "above" and clear > threshold) or (tkey.op == "below" and clear < threshold)):
            faults.append(Fault(line_of(clear_key), clear_key, f"{clear!r} is on the wrong side of the threshold "
                                                               f"{threshold:g}: hysteresis clears "
                                                               f"{'below' if tkey.op == 'above' else 'above'} it"))
    labels = body.get("labels", {})
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        faults.append(Fault(line_of("labels"), "labels", "must be a table of strings, e.g. labels = { team = \"ml\" }"))
    enabled = body.get("enabled", True)
    if not isinstance(enabled, bool):
        faults.append(Fault(line_of("enabled"), "enabled", f"must be true or false, got {enabled!r}"))
    kind = body.get("kind", DEFAULT_KIND.get(signal, "fault"))
    if not isinstance(kind, str) or kind not in KINDS:
        faults.append(Fault(line_of("kind"), "kind", f"{kind!r} is not a kind of alert{_nearest(str(kind), list(KINDS)).replace('valid keys', 'kinds')}"
                            f" (fault: opens an incident naming a culprit; sla: a figure past its objective; "
                            f"hardware: the GPU's own report); signal '{signal}' is \"{DEFAULT_KIND.get(signal, 'fault')}\" "
                            "unless you say otherwise"))
    if len(faults) > n0:
        return None
    return Rule(name=name, signal=signal, scope=scope, threshold_key=tkey.name, threshold=threshold, op=tkey.op,
                params=params, for_steps=int(for_steps or 1), for_s=float(for_s or 0.0),
                clear=float(clear) if clear is not None else None, keep_firing=float(keep), severity=severity,
                labels=dict(labels),
                enabled=enabled, line=hline, kind=kind)


def _read(path: str) -> str:
    """The rules file's text; RulesError naming what is wrong with the file itself."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise RulesError(path, [Fault(0, "", f"cannot read the rules file: {e.strerror}")]) from None
    except UnicodeDecodeError as e:
        raise RulesError(path, [Fault(1, "", f"not UTF-8 text ({e.reason}); save the rules file as UTF-8")]) from None


def load(path: str) -> list[Rule]:
    return parse(_read(path), path)


def load_all(path: str) -> tuple[list[Rule], CostSettings]:
    """The rules and the [cost] table of a rules file."""
    return parse_all(_read(path), path)


#: The built-in set (DESIGN's SLA table), as the file `tracetop rules defaults` prints.
DEFAULTS_TOML = """\
# tracetop rules: the built-in set. Start from this file: `tracetop rules defaults > rules.toml`,
# edit, check with `tracetop rules check rules.toml`, run with `tracetop collector --rules rules.toml`.
# A rule: signal, scope, one threshold whose key carries its unit, a hold (for_steps per completed
# step, or for_s on the timer), optional hysteresis (clear_below / clear_above), a resolve hold
# (keep_firing_steps, default 10: a breach again within it is the same alert; keep_firing_s for timer
# signals, default 0), severity, labels, and optionally kind: "fault" (opens an incident naming the
# culprit and the cause), "sla" (a figure past its objective; a consequence where an incident explains
# it) or "hardware"; each signal has its own (docs/outputs.md, "Incidents").

[rule.straggler]
signal = "straggler"
scope = "rank"
excess_ms_above = 50          # computes this much longer than its stage's other ranks' median
compute_ratio_above = 1.5     # ... and this many times their median (z-score too, with 5+ ranks a stage)
z_above = 3.5
for_steps = 6                 # a rank descheduled for a few steps on a busy host is not a straggler
severity = "warning"

[rule.data_stall]
signal = "data_stall"         # a rank's data loader paces the step (cause: data, not the network)
excess_ms_above = 50          # waits this much longer for its data than its stage's other ranks' median
data_ratio_above = 2.0        # ... and this many times their median (z-score too, with 5+ ranks a stage)
z_above = 3.5
for_steps = 3
severity = "warning"

[rule.silent_rank]
signal = "silent_rank"
silent_s_above = 15
severity = "critical"

[rule.stuck_collective]
signal = "stuck_collective"
stuck_s_above = 15           # a rank in one collective (or stalled while its peers wait there) this long
severity = "critical"

[rule.first_failure]
signal = "first_failure"      # the run stopped (ranks killed, ended by the launcher): who went first
silent_s_above = 15           # every rank closed or silent this long (a rank killed while its peers
severity = "critical"         # live on is silent_rank's)

[rule.unheard_rank]
signal = "unheard_rank"       # a rank of the world size (RUN_START) never heard while its peers are
unheard_s_above = 15
severity = "critical"

[rule.grad_sync]
signal = "grad_sync"
grad_sync_ms_above = 200
for_steps = 3
severity = "warning"

[rule.grad_sync_scaling]
signal = "grad_sync_scaling"  # needs a baseline (--baseline RUN_ID)
sqrt_k_ratio_above = 1.0
for_steps = 3
severity = "warning"

[rule.comm_share]
signal = "comm_share"
comm_share_above = 0.30
for_steps = 5
severity = "warning"

[rule.bubble_warn]
signal = "bubble"
scope = "stage"
waiting_share_above = 0.15
imbalance_above = 1.2         # the slow stage is named when slowest/fastest compute is above this
for_steps = 5
clear_below = 0.12
severity = "warning"

[rule.bubble_critical]
signal = "bubble"
scope = "stage"
waiting_share_above = 0.30
imbalance_above = 1.2
for_steps = 5
severity = "critical"

[rule.stage_imbalance]
signal = "stage_imbalance"
imbalance_above = 1.2
for_steps = 5
severity = "warning"

[rule.scaling_efficiency]
signal = "scaling_efficiency"  # against --baseline RUN_ID, or declare per_rank_tokens_per_s
efficiency_below = 0.75
for_steps = 3
severity = "warning"

[rule.memory]
signal = "memory"
used_of_budget_above = 0.90
for_steps = 1
severity = "critical"

[rule.offload_bandwidth]
signal = "offload_bandwidth"
offload_gbps_below = 5
for_steps = 3
severity = "warning"

[rule.loss_spike]
signal = "loss_spike"
spike_share_above = 0.15      # loss 15% over its rolling median
window_steps = 16
for_steps = 1
severity = "warning"

[rule.xid]
signal = "xid"
scope = "gpu"
xid_count_above = 0
severity = "critical"

[rule.thermal_throttle]
signal = "thermal_throttle"
throttled_share_above = 0.5
for_s = 30
severity = "warning"

[rule.ecc]
signal = "ecc"
ecc_errors_above = 0
severity = "critical"

[rule.collector_behind]
signal = "collector_behind"   # the collector cannot keep up: streams held by backpressure, batches waiting
scope = "collector"           # for their commit; shippers keep, spool or drop (and count) what it cannot take
behind_s_above = 10           # behind this long without a break
clear_below = 1               # once firing, it fires while behind at all ...
keep_firing_s = 5             # ... and resolves once caught up this long
severity = "warning"

[rule.cross_node_share]
signal = "cross_node_share"   # a DP/TP group's communication time mostly between nodes, the group named
scope = "role"
cross_share_above = 0.60      # the seed: "all-reduce timeouts because cross-rack traffic exceeds 60%"
every_s = 60                  # an SQL query over the last window_s of collective rows, this often
window_s = 30                 # (16,384 ranks: 0.5 M rows a query; docs/dashboard.md, "what they cost")
severity = "warning"

[rule.hardware_risk]
signal = "hardware_risk"      # a GPU likely to fail (the hardware_risk view's level fail_likely), with evidence
scope = "gpu"
risk_points_above = 3         # 4 points or more: "likely to fail"
every_s = 300                 # an SQL query over the last window_s of the agents' GPU samples, this often
window_s = 43200              # 12 h: the ECC doubling time and the remaps' rise are read over it
severity = "warning"

[rule.fragmentation]
signal = "fragmentation"      # a rank's device allocator fragmentation rising (GPU runs; CPU is not measured)
scope = "rank"
frag_rise_per_100_steps_above = 0.10  # (reserved - allocated) / reserved rising this much per 100 steps
frag_share_above = 0.25       # ... and standing above this
every_s = 60
window_s = 120
severity = "warning"

[rule.throughput_per_gpu]
signal = "throughput_per_gpu"  # off unless declared: set your SLA and enabled = true
tokens_per_s_below = 1000
for_steps = 5
severity = "warning"
enabled = false

# What the run lost (GPU-hours to stragglers, data waits, pipeline waiting above the 1F1B ideal,
# exposed communication above a baseline): the `lost_time` view, /metrics, the TUI, the report.
[cost]
comm_baseline_share = 0.30    # exposed communication up to this share of the step is not counted as lost
window_s = 600                # the "last 10 minutes" of the gauges and the TUI line
# price_per_gpu_hour = 2.50   # declare it to see money beside GPU-hours (or --price-per-gpu-hour)
# currency = "USD"
"""


def defaults() -> list[Rule]:
    return parse(DEFAULTS_TOML, "<built-in rules>")
