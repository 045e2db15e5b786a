"""The committed fixture (scripts/make_fixture.py) and what a test may know about it.

Expected values come from the file's raw tables (the `raw` helpers) or from the known injection
(STRAGGLER_RANK from STRAGGLER_FROM_STEP on), never from numbers written here, so the fixture can
be regenerated with `python scripts/make_fixture.py --out tests/fixtures/straggler_run.duckdb`.
"""

from __future__ import annotations

import importlib.util

import duckdb
import numpy as np

from tests.support import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "straggler_run.duckdb"

_spec = importlib.util.spec_from_file_location("make_fixture", ROOT / "scripts" / "make_fixture.py")
make_fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixture)  # type: ignore[union-attr]

RUN_ID = make_fixture.RUN_ID
STRAGGLER_RANK = make_fixture.STRAGGLER_RANK
STRAGGLER_MS = make_fixture.STRAGGLER_MS
STRAGGLER_FROM_STEP = make_fixture.STRAGGLER_FROM_STEP


def connect_ro():
    """The fixture read-only, with FileSource's configuration (DuckDB refuses two configurations of
    one file in one process)."""
    return duckdb.connect(str(FIXTURE), read_only=True, config={"enable_external_access": False})


def raw(sql: str, params: list | None = None) -> list[tuple]:
    con = connect_ro()
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def last_step() -> int:
    return int(raw("SELECT max(step) FROM step WHERE run_id = ?", [RUN_ID])[0][0])


def compute_ms(step: int) -> dict[int, float]:
    return {int(r): c / 1e6 for r, c in raw("SELECT rank, compute_ns FROM step WHERE run_id = ? AND step = ?",
                                            [RUN_ID, step])}


def replay_into(endpoint: str, *, run_id: str = RUN_ID, steps: tuple[int, int] = (-1, 1 << 62),
                token: str | None = None) -> dict[str, int]:
    """Ship the fixture's recorded rows of steps lo..hi (every event table; rows of no step, such
    as the agent's and run_start, go with lo = -1) into a collector through a real Shipper;
    returns rows shipped per table."""
    from tracetop.events import SCHEMAS, Kind, table_name
    from tracetop.wire.shipper import Shipper

    con = connect_ro()
    meta = (("authorization", f"Bearer {token}"),) if token else None
    shipper = Shipper(endpoint, run_id=run_id, source_id=f"replay-{run_id}-{np.random.randint(1 << 30)}",
                      call_metadata=meta)
    counts = {}
    try:
        for kind in Kind:
            name = table_name(kind)
            cols = [c.name for c in SCHEMAS[kind]]
            where = "WHERE run_id = ? AND step BETWEEN ? AND ?"
            params = [RUN_ID, steps[0], steps[1]]
            if kind == Kind.RUN_START:
                where, params = "WHERE run_id = ?", [RUN_ID] if steps[0] <= -1 else [""]
            have = {r[0] for r in con.execute(f"DESCRIBE {name}").fetchall()}
            # a column newer than the committed file (GPU_SAMPLE's schema-3 ones) ships as NULL
            sel = ", ".join(f'"{c}"' if c in have else f'NULL AS "{c}"' for c in cols)
            t = con.sql(f"SELECT {sel} FROM {name} {where}", params=params).to_arrow_table()
            if t.num_rows == 0:
                continue
            data = {}
            for c in SCHEMAS[kind]:
                v = t.column(c.name)
                if c.dtype == "str":
                    data[c.name] = [x if x is not None else "" for x in v.to_pylist()]
                elif c.dtype == "f8":
                    data[c.name] = np.asarray(v.to_numpy(zero_copy_only=False), dtype="<f8")
                else:
                    data[c.name] = np.asarray(v.fill_null(-1).to_numpy(zero_copy_only=False), dtype="<" + c.dtype)
            shipper.record_many(kind, data)
            counts[name] = t.num_rows
        assert shipper.flush(timeout_s=60), "the collector did not ack the replayed rows"
    finally:
        shipper.close()
        con.close()
    return counts


def same_table(a, b, where: str) -> None:
    """Two Arrow tables hold the same rows: same schema, equal values, floats to 1e-9 (a sum or a
    mean taken in another order differs in the last digits)."""
    import math

    assert a.schema == b.schema, f"{where}: schemas differ\nlive: {a.schema}\nsql:  {b.schema}"
    la, lb = a.to_pylist(), b.to_pylist()
    assert len(la) == len(lb), f"{where}: {len(la)} live rows, {len(lb)} SQL rows"
    for i, (ra, rb) in enumerate(zip(la, lb)):
        for k in ra:
            x, y = ra[k], rb[k]
            if isinstance(x, float) and isinstance(y, float):
                if math.isnan(x) and math.isnan(y):
                    continue
                assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9), f"{where} row {i} {k}: live {x} sql {y}"
            else:
                assert x == y, f"{where} row {i} {k}: live {x!r} sql {y!r}"
