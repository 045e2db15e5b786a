"""The committed generated code matches the .proto, and the Python event model matches the proto enum."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import ROOT
from tracetop.events import SCHEMAS, Kind
from tracetop.wire import tracetop_pb2 as pb


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)], check=True)
    for name in ("tracetop_pb2.py", "tracetop_pb2.pyi", "tracetop_pb2_grpc.py"):
        committed = (ROOT / "tracetop" / "wire" / name).read_text()
        fresh = (tmp_path / name).read_text()
        assert committed == fresh, f"{name} is stale: run `python scripts/gen_proto.py` and commit the result"


def test_event_kinds_match_proto_enum() -> None:
    proto = {name: value for name, value in pb.EventKind.items() if value != 0}
    assert proto == {k.name: k.value for k in Kind}
    assert set(SCHEMAS) == set(Kind), "every kind needs a schema"


def test_every_schema_starts_with_the_common_columns() -> None:
    for kind, cols in SCHEMAS.items():
        assert [c.name for c in cols[:4]] == ["rank", "step", "start_ns", "duration_ns"], kind
        assert len({c.name for c in cols}) == len(cols), f"{kind.name} repeats a column name"
        assert all(c.dtype in ("i4", "i8", "f8", "str") for c in cols)
