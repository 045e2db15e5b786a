"""The seed dashboard's views (issue 25), defined at query time: communication topology, hardware
risk ahead of failure, memory fragmentation, and the judgments read from them.

They are not in the file's schema (no migration): `install(con)` creates each as a TEMP view on a
connection (read-only ones included: a temp view lives in the connection's memory, not the file),
for every name the file does not already define. `tracetop query FILE`, the TUI's file source and
the report call it, so `SELECT * FROM comm_topology` answers on any collector file, old ones too.
The SQL texts also take a `where` over the collective rows (`comm_topology_sql("step BETWEEN ..")`)
so a screen reads a window of steps, not the whole run.

comm_topology: one row per (run_id, role, group, op, src_node, dst_node), over collective rows
(pipe sends/receives included: they are `collective` rows with a peer).
- A rank's node is run_start.hostname.
- Point-to-point rows (peer >= 0) are a link from the sender's node to the receiver's (a recv row
  is charged to the link it waited on); the group is `role[a,b]`.
- A group collective is charged to the link from the rank's node to the node of the next rank of
  its group (a ring, ranks in order: what NCCL's ring and gloo's ring all-reduce walk). Group
  membership is not on the wire (a row has its role and group size only), so it is rebuilt from the
  run's layout (run_start tp/pp/dp; ranks pipe-major, then data, then tensor, the reference
  trainer's and DeepSpeed's order): the first of `dp`/`tp`/`pp` in the role names the axis; any
  other role (`world`, a user's `group`) is one group of every rank that issued it. A trainer with
  another layout gets wrong groups: its roles still split the time, the links may not.
- Columns: cross_node (src_node <> dst_node), calls, bytes, time_ms (sum of the calls' durations),
  latency_ms_p50/p99 (call duration), busbw_gbps (median bytes / duration x the op's bus factor).

comm_cross_share: per (run_id, role, group): nodes (distinct nodes of its ranks), time_ms,
cross_time_share and cross_bytes_share (the share of its time and bytes on cross-node links).

hardware_risk: one row per (node, gpu) over every agent sample of it in the file (any run id: the
agent ships under its own), from gpu_sample and xid. Score points, each with its evidence:
- uncorrected ECC count rising (volatile, since the driver loaded): 3 when it grows with a doubling
  time of 12 h or less (regression of ln(count) on hours), else 1 when it rose at all;
- remapped rows (correctable + uncorrectable) rising over the history: 2 when by 2 or more, else 1;
- XID events: 3 for a memory / fallen-off-the-bus XID (48, 63, 64, 74, 79, 92, 94, 95), else 1;
- HW slowdown / HW thermal / power brake throttle in over 10% of samples: 1; 85 °C or more: 1;
- clock drops under load (util >= 50% and SM clock under 80% of the GPU's highest): over 10% of
  those samples: 1.
risk: points / 6 capped at 1; level `fail_likely` at 4 points or more, `watch` at 2-3, else `ok`.
Not measured (the agent does not store them yet): corrected ECC counts, pending remaps, PCIe
replay counters, the GPU's own temperature thresholds. The weights are set on fake traces
(tests/collector/test_dashboard_risk.py), not on a fleet's failures: see docs/dashboard.md.
"""

from __future__ import annotations

#: the cross-node share of a DP/TP group's communication time above which it is judged (the seed:
#: "all-reduce timeouts because cross-rack traffic exceeds 60%")
CROSS_NODE_SHARE = 0.60

_RANKS = """
rk AS (SELECT run_id, rank, any_value(hostname) AS node, greatest(max(tp), 1) AS tp, greatest(max(dp), 1) AS dp
       FROM run_start GROUP BY run_id, rank),
rc AS (SELECT run_id, rank, node, CAST(rank // (tp * dp) AS INTEGER) AS stage_c,
              CAST((rank // tp) % dp AS INTEGER) AS replica, CAST(rank % tp AS INTEGER) AS tp_rank FROM rk)"""


def comm_topology_sql(where: str = "TRUE") -> str:
    """The comm_topology view's text, over the collective rows matching `where` (SQL)."""
    return f"""
WITH c0 AS (SELECT * FROM collective WHERE ({where})),
{_RANKS},
roles AS (SELECT DISTINCT run_id, role FROM c0 WHERE coalesce(peer, -1) < 0),
ax AS (SELECT run_id, role, coalesce(list_filter(string_split(role, '|'), lambda x: x IN ('dp', 'tp', 'pp'))[1],
                                     'any') AS axis FROM roles),
mem AS (SELECT ax.run_id, ax.role, ax.axis, rc.rank, rc.node,
               CASE ax.axis WHEN 'dp' THEN 's' || stage_c || 't' || tp_rank
                            WHEN 'tp' THEN 's' || stage_c || 'r' || replica
                            WHEN 'pp' THEN 'r' || replica || 't' || tp_rank ELSE '' END AS gkey
        FROM ax JOIN rc ON rc.run_id = ax.run_id
        WHERE ax.axis <> 'any' OR rc.rank IN (SELECT rank FROM c0 WHERE c0.run_id = ax.run_id AND c0.role = ax.role)),
ring AS (SELECT run_id, role, gkey, rank, node,
                coalesce(lead(node) OVER (PARTITION BY run_id, role, gkey ORDER BY rank),
                         first_value(node) OVER (PARTITION BY run_id, role, gkey ORDER BY rank)) AS next_node
         FROM mem),
grp AS (SELECT run_id, role, gkey,
               split_part(role, '|', 1) || '[' || array_to_string(list_slice(list(rank ORDER BY rank), 1, 8), ',')
               || CASE WHEN count(*) > 8 THEN ',…+' || (count(*) - 8) ELSE '' END || ']' AS grp
        FROM mem GROUP BY run_id, role, gkey),
rows AS (
    SELECT c.run_id, c.role, g.grp, c.op, r.node AS src_node, r.next_node AS dst_node, c.bytes, c.duration_ns,
           c.group_size
    FROM c0 c JOIN ring r ON r.run_id = c.run_id AND r.role = c.role AND r.rank = c.rank
    JOIN grp g ON g.run_id = r.run_id AND g.role = r.role AND g.gkey = r.gkey
    WHERE coalesce(c.peer, -1) < 0
    UNION ALL
    SELECT c.run_id, c.role,
           c.role || '[' || least(c.rank, c.peer) || ',' || greatest(c.rank, c.peer) || ']' AS grp, c.op,
           CASE WHEN c.op LIKE '%recv%' THEN b.node ELSE a.node END AS src_node,
           CASE WHEN c.op LIKE '%recv%' THEN a.node ELSE b.node END AS dst_node, c.bytes, c.duration_ns, 2
    FROM c0 c JOIN rc a ON a.run_id = c.run_id AND a.rank = c.rank JOIN rc b ON b.run_id = c.run_id AND b.rank = c.peer
    WHERE c.peer >= 0
)
SELECT run_id, role, grp AS "group", op, src_node, dst_node, src_node <> dst_node AS cross_node,
       count(*) AS calls, CAST(sum(bytes) AS BIGINT) AS bytes, sum(duration_ns) / 1e6 AS time_ms,
       quantile_cont(duration_ns, 0.5) / 1e6 AS latency_ms_p50, quantile_cont(duration_ns, 0.99) / 1e6 AS latency_ms_p99,
       quantile_cont(bytes / nullif(duration_ns, 0) *
                     CASE WHEN op LIKE 'all_reduce%' THEN 2.0 * (group_size - 1) / greatest(group_size, 1)
                          WHEN op LIKE '%all_gather%' OR op LIKE '%reduce_scatter%' OR op LIKE 'all_to_all%'
                               THEN 1.0 * (group_size - 1) / greatest(group_size, 1)
                          ELSE 1.0 END, 0.5) AS busbw_gbps
FROM rows GROUP BY ALL
"""


def comm_cross_share_sql(where: str = "TRUE") -> str:
    return f"""
WITH t AS ({comm_topology_sql(where)})
SELECT run_id, role, "group", count(DISTINCT src_node) AS nodes, sum(calls) AS calls, sum(time_ms) AS time_ms,
       coalesce(sum(time_ms) FILTER (WHERE cross_node) / nullif(sum(time_ms), 0), 0) AS cross_time_share,
       coalesce(sum(bytes) FILTER (WHERE cross_node) / nullif(sum(bytes), 0), 0) AS cross_bytes_share
FROM t GROUP BY run_id, role, "group"
"""


#: corrected ECC errors score when they rose by at least this many over the window and their rate
#: doubles within CECC_DOUBLING_H (and within half the window: the two halves' rates at least x2)
CECC_MIN_RISE = 20
CECC_DOUBLING_H = 12
#: thermal margin (slowdown temperature - temperature) at or below which a GPU scores a point
THERMAL_MARGIN_C = 5
#: PCIe replays or correctable errors over the window that score a point
PCIE_ERRORS_RISE = 100

#: XIDs that mean the memory or the bus is failing (NVIDIA's XID catalogue)
FATAL_XIDS = (48, 63, 64, 74, 79, 92, 94, 95)


#: GPU_SAMPLE columns of wire schema 3 (file schema 14); older files read them as NULL
_RISK_V3_COLUMNS = ("ecc_corrected", "remap_pending", "remap_failure", "pcie_replays", "pcie_correctable",
                    "temp_slowdown_c", "power_limit_mw")


def hardware_risk_sql(until_ns: str = "9223372036854775807", where: str = "TRUE") -> str:
    """The hardware_risk view's text, over samples (and XIDs) at or before `until_ns` (an SQL
    expression) that match `where` (SQL over gpu_sample / xid columns). A file older than schema
    14 has no corrected-ECC, remap-flag, PCIe-error, threshold or power-limit columns: they read NULL
    (UNION ALL BY NAME with an empty row of them) and score nothing."""
    fatal = ", ".join(map(str, FATAL_XIDS))
    v3 = ", ".join(f"CAST(NULL AS DOUBLE) AS {c}" for c in _RISK_V3_COLUMNS)
    return f"""
WITH gs AS (SELECT * FROM gpu_sample UNION ALL BY NAME SELECT {v3} WHERE false),
s0 AS (SELECT node, gpu, start_ns, (start_ns - min(start_ns) OVER (PARTITION BY node, gpu)) / 3.6e12 AS h,
                  ecc_uncorrected AS ecc, remapped_rows, temp_c, power_mw, util_pct, sm_clock_mhz,
                  CAST(coalesce(clock_event_reasons, 0) AS BIGINT) AS reasons,
                  ecc_corrected AS cecc, remap_pending, remap_failure, pcie_replays, pcie_correctable,
                  temp_slowdown_c - temp_c AS margin_c,
                  CASE WHEN power_limit_mw > 0 AND power_mw > 1.05 * power_limit_mw THEN 1.0 ELSE 0.0 END AS power_over
           FROM gs WHERE gpu >= 0 AND start_ns <= {until_ns} AND ({where})),
s AS (SELECT *, max(h) OVER (PARTITION BY node, gpu) AS hmax FROM s0),
g AS (SELECT node, gpu, count(*) AS samples, max(h) AS hours, min(start_ns) AS first_ns, max(start_ns) AS last_ns,
             arg_max(ecc, start_ns) AS ecc_now, arg_min(ecc, start_ns) AS ecc_first,
             regr_slope(ln(ecc), h) FILTER (WHERE ecc > 0) AS ecc_log_slope, count(*) FILTER (WHERE ecc > 0) AS ecc_n,
             arg_max(remapped_rows, start_ns) AS remaps_now, arg_min(remapped_rows, start_ns) AS remaps_first,
             arg_max(cecc, start_ns) AS cecc_now, arg_min(cecc, start_ns) AS cecc_first,
             arg_max(cecc, start_ns) FILTER (WHERE h <= hmax / 2) AS cecc_mid,
             arg_max(remap_pending, start_ns) AS remap_pending, max(remap_failure) AS remap_failure,
             arg_max(pcie_replays, start_ns) - arg_min(pcie_replays, start_ns) AS pcie_replays_rise,
             arg_max(pcie_correctable, start_ns) - arg_min(pcie_correctable, start_ns) AS pcie_correctable_rise,
             min(margin_c) AS thermal_margin_c, avg(power_over) AS power_excursion_share,
             max(temp_c) AS temp_c_max, max(power_mw) / 1e3 AS power_w_max,
             avg(CASE WHEN (reasons & 392) <> 0 THEN 1.0 ELSE 0.0 END) AS hw_throttle_share,
             max(sm_clock_mhz) AS clock_max
      FROM s GROUP BY node, gpu),
ld AS (SELECT s.node, s.gpu, avg(CASE WHEN s.sm_clock_mhz < 0.8 * g.clock_max THEN 1.0 ELSE 0.0 END) AS clock_drop_share
       FROM s JOIN g USING (node, gpu) WHERE s.util_pct >= 50 GROUP BY s.node, s.gpu),
x AS (SELECT node, gpu, count(*) AS xids, count(*) FILTER (WHERE xid IN ({fatal})) AS fatal_xids,
             string_agg(DISTINCT CAST(xid AS VARCHAR), ',') AS xid_list
      FROM xid WHERE gpu >= 0 AND start_ns <= {until_ns} AND ({where}) GROUP BY node, gpu),
f0 AS (SELECT g.*, coalesce(ld.clock_drop_share, 0) AS clock_drop_share, coalesce(x.xids, 0) AS xids,
             coalesce(x.fatal_xids, 0) AS fatal_xids, x.xid_list,
             CASE WHEN ecc_n >= 3 AND ecc_log_slope > 0 THEN ln(2) / ecc_log_slope END AS ecc_doubling_h,
             coalesce(ecc_now, 0) - coalesce(ecc_first, 0) AS ecc_rise,
             coalesce(remaps_now, 0) - coalesce(remaps_first, 0) AS remaps_rise,
             coalesce(cecc_now, 0) - coalesce(cecc_first, 0) AS cecc_rise,
             (cecc_mid - cecc_first) / nullif(hours / 2, 0) AS cecc_rate_early,
             (cecc_now - cecc_mid) / nullif(hours / 2, 0) AS cecc_rate_late
      FROM g LEFT JOIN ld USING (node, gpu) LEFT JOIN x USING (node, gpu)),
f AS (SELECT *,
             -- the corrected-error rate's doubling time, from the rates of the window's two halves
             CASE WHEN cecc_rate_early > 0 AND cecc_rate_late > cecc_rate_early
                  THEN (hours / 2) / log2(cecc_rate_late / cecc_rate_early) END AS cecc_doubling_h
      FROM f0),
p AS (SELECT *,
             CASE WHEN ecc_rise > 0 AND ecc_doubling_h <= 12 THEN 3 WHEN ecc_rise > 0 THEN 1 ELSE 0 END AS p_ecc,
             CASE WHEN cecc_rise >= {CECC_MIN_RISE} AND cecc_doubling_h <= least({CECC_DOUBLING_H}, hours / 2) THEN 2
                  WHEN cecc_rise >= {CECC_MIN_RISE} AND cecc_rate_early = 0 THEN 1 ELSE 0 END AS p_cecc,
             CASE WHEN remaps_rise >= 2 THEN 2 WHEN remaps_rise > 0 THEN 1 ELSE 0 END AS p_remap,
             CASE WHEN remap_failure > 0 THEN 4 WHEN remap_pending > 0 THEN 2 ELSE 0 END AS p_pending,
             CASE WHEN fatal_xids > 0 THEN 3 WHEN xids > 0 THEN 1 ELSE 0 END AS p_xid,
             CASE WHEN hw_throttle_share > 0.1 THEN 1 ELSE 0 END
             + CASE WHEN coalesce(thermal_margin_c <= {THERMAL_MARGIN_C}, temp_c_max >= 85) THEN 1 ELSE 0 END AS p_thermal,
             CASE WHEN clock_drop_share > 0.1 THEN 1 ELSE 0 END AS p_clock,
             CASE WHEN pcie_replays_rise >= {PCIE_ERRORS_RISE} OR pcie_correctable_rise >= {PCIE_ERRORS_RISE}
                  THEN 1 ELSE 0 END AS p_pcie,
             CASE WHEN power_excursion_share > 0.1 THEN 1 ELSE 0 END AS p_power
      FROM f),
t AS (SELECT *, p_ecc + p_cecc + p_remap + p_pending + p_xid + p_thermal + p_clock + p_pcie + p_power AS points FROM p)
SELECT node, gpu, samples, hours, first_ns, last_ns, ecc_now, ecc_rise, ecc_doubling_h, remaps_now, remaps_rise,
       cecc_now, cecc_rise, cecc_doubling_h, remap_pending, remap_failure, pcie_replays_rise, pcie_correctable_rise,
       thermal_margin_c, power_excursion_share,
       xids, xid_list, temp_c_max, power_w_max, hw_throttle_share, clock_drop_share,
       points, least(1.0, points / 6.0) AS risk,
       CASE WHEN points >= 4 THEN 'fail_likely' WHEN points >= 2 THEN 'watch' ELSE 'ok' END AS level,
       concat_ws(', ',
         CASE WHEN p_ecc = 3 THEN 'uncorrected ECC errors ' || CAST(ecc_now AS BIGINT) || ', doubling every '
                                  || printf('%.1f', ecc_doubling_h) || ' h'
              WHEN p_ecc = 1 THEN 'uncorrected ECC errors up ' || CAST(ecc_rise AS BIGINT) END,
         CASE WHEN p_cecc = 2 THEN 'corrected ECC errors doubling every ' || printf('%.1f', cecc_doubling_h)
                                   || ' h (' || CAST(cecc_rise AS BIGINT) || ' in ' || printf('%.0f', hours) || ' h)'
              WHEN p_cecc = 1 THEN 'corrected ECC errors began: ' || CAST(cecc_rise AS BIGINT) || ' in '
                                   || printf('%.0f', hours / 2) || ' h' END,
         CASE WHEN p_remap > 0 THEN CAST(remaps_rise AS BIGINT) || ' rows remapped' END,
         CASE WHEN p_pending = 4 THEN 'row remapping failed' WHEN p_pending = 2 THEN 'a row remap pending (needs a reset)' END,
         CASE WHEN xids > 0 THEN 'XID ' || xid_list END,
         CASE WHEN hw_throttle_share > 0.1 THEN 'HW throttle ' || CAST(round(100 * hw_throttle_share) AS BIGINT)
                                               || '% of samples' END,
         CASE WHEN thermal_margin_c <= {THERMAL_MARGIN_C} THEN CAST(temp_c_max AS BIGINT) || '°C, '
                                               || CAST(thermal_margin_c AS BIGINT) || '°C below slowdown'
              WHEN thermal_margin_c IS NULL AND temp_c_max >= 85 THEN CAST(temp_c_max AS BIGINT) || '°C' END,
         CASE WHEN clock_drop_share > 0.1 THEN 'clock drops under load ' ||
                                               CAST(round(100 * clock_drop_share) AS BIGINT) || '%' END,
         CASE WHEN p_pcie > 0 THEN 'PCIe replays up ' || CAST(coalesce(pcie_replays_rise, 0) AS BIGINT)
                                   || ', correctable errors up ' || CAST(coalesce(pcie_correctable_rise, 0) AS BIGINT) END,
         CASE WHEN p_power > 0 THEN 'power above its limit in ' || CAST(round(100 * power_excursion_share) AS BIGINT)
                                    || '% of samples' END) AS evidence
FROM t ORDER BY points DESC, node, gpu
"""


def memory_fragmentation_sql(where: str = "TRUE") -> str:
    """The memory_fragmentation view's text over the memory rows matching `where`: per (run_id,
    rank, step), the device allocator's reserved - allocated bytes and its share of reserved (the
    step's last row). GPU only: on CPU the hooks record the resident set but not the bytes of the
    live tensors, so frag_bytes / frag_share are NULL there (measured = 'cpu: not measured')."""
    return f"""
SELECT run_id, rank, step, arg_max(reserved_bytes, start_ns) AS reserved_bytes,
       arg_max(allocated_bytes, start_ns) AS allocated_bytes,
       CASE WHEN arg_max(allocated_bytes, start_ns) >= 0 AND arg_max(reserved_bytes, start_ns) > 0
            THEN arg_max(reserved_bytes, start_ns) - arg_max(allocated_bytes, start_ns) END AS frag_bytes,
       CASE WHEN arg_max(allocated_bytes, start_ns) >= 0 AND arg_max(reserved_bytes, start_ns) > 0
            THEN 1.0 - arg_max(allocated_bytes, start_ns) / arg_max(reserved_bytes, start_ns) END AS frag_share,
       CASE WHEN arg_max(allocated_bytes, start_ns) >= 0 THEN 'device: reserved - allocated'
            ELSE 'cpu: not measured' END AS measured
FROM memory WHERE step >= 0 AND ({where}) GROUP BY run_id, rank, step
"""


def fragmentation_trend_sql(where: str = "TRUE") -> str:
    """Per (run_id, rank): the fragmentation share's first, last, median and slope per 100 steps (GPU rows)."""
    return f"""
SELECT run_id, rank, count(frag_share) AS steps, arg_min(frag_share, step) AS frag_share_first,
       arg_max(frag_share, step) AS frag_share_last, median(frag_share) AS frag_share_median,
       100 * regr_slope(frag_share, step) AS frag_share_per_100_steps
FROM ({memory_fragmentation_sql(where)}) WHERE frag_share IS NOT NULL GROUP BY run_id, rank
"""


#: the fragmentation judgment: the share rose by this much per 100 steps, and stands above FRAG_SHARE
FRAG_RISE_PER_100_STEPS = 0.10
FRAG_SHARE = 0.25


def fragmenting_ranks(con, run_id: str, rise: float = FRAG_RISE_PER_100_STEPS, share: float = FRAG_SHARE,
                      where: str = "TRUE") -> list[dict]:
    """Ranks of `run_id` whose allocator fragmentation is rising: slope above `rise` per 100 steps,
    the last share above `share` and above the window's median (still rising at its end: a rank
    whose first step read 0 and then stays flat has a slope, not a rise), over the memory rows
    matching `where`."""
    return rows(con, f"SELECT * FROM ({fragmentation_trend_sql(where)}) WHERE run_id = ? "
                      "AND frag_share_per_100_steps > ? AND frag_share_last > ? "
                      "AND frag_share_last > frag_share_median ORDER BY rank", [run_id, rise, share])


#: name -> view text; install() creates those a file does not define
VIEWS: dict[str, str] = {
    "comm_topology": comm_topology_sql(),
    "comm_cross_share": comm_cross_share_sql(),
    "hardware_risk": hardware_risk_sql(),
    "memory_fragmentation": memory_fragmentation_sql(),
    "fragmentation_trend": fragmentation_trend_sql(),
}


def install(con) -> list[str]:
    """Create the VIEWS the connection's database lacks as TEMP views; return their names. Needs
    the file's collective, run_start, gpu_sample and xid tables (every schema since v1 has them)."""
    have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    made = []
    for name, sql in VIEWS.items():
        if name not in have:
            try:
                con.execute(f"CREATE TEMP VIEW {name} AS {sql}")
            except Exception:  # not a collector file (a table missing): the view is left out, the query says so
                continue
            made.append(name)
    return made


def rows(con, sql: str, params: list) -> list[dict]:
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def cross_node_groups(con, run_id: str, threshold: float = CROSS_NODE_SHARE, where: str = "TRUE") -> list[dict]:
    """DP/TP groups of `run_id` whose cross-node share of communication time is above `threshold`,
    worst first: the judgment of the seed's "cross-rack traffic exceeds 60%"."""
    sql = (f"SELECT * FROM ({comm_cross_share_sql(where)}) WHERE run_id = ? AND cross_time_share > ? "
           "AND list_has_any(string_split(role, '|'), ['dp', 'tp']) ORDER BY cross_time_share DESC, \"group\"")
    return rows(con, sql, [run_id, threshold])


def slowest_links(con, run_id: str, limit: int = 5, where: str = "TRUE") -> list[dict]:
    """The (group, op, src_node -> dst_node) links of `run_id` with the highest median latency."""
    sql = (f"SELECT * FROM ({comm_topology_sql(where)}) WHERE run_id = ? "
           "ORDER BY latency_ms_p50 DESC LIMIT ?")
    return rows(con, sql, [run_id, limit])


#: the points at which hardware_risk's level is fail_likely
FAIL_LIKELY_POINTS = 4


def risky_gpus(con, until_ns: int | None = None, *, min_points: int = FAIL_LIKELY_POINTS,
               where: str = "TRUE") -> list[dict]:
    """GPUs with `min_points` or more (by default level fail_likely), over the samples matching
    `where`, each with a sentence: "GPU 3 on node-7: ... — likely to fail" (or its points below)."""
    sql = hardware_risk_sql(str(int(until_ns)) if until_ns is not None else "9223372036854775807", where)
    gpus = rows(con, f"SELECT * FROM ({sql}) WHERE points >= ?", [min_points])
    for r in gpus:
        verdict = "likely to fail" if r["level"] == "fail_likely" else f"risk {r['points']} points ({r['level']})"
        r["message"] = f"GPU {r['gpu']} on {r['node']}: {r['evidence']} — {verdict}"
    return gpus
