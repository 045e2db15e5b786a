#!/usr/bin/env python
"""Regenerate tracetop/wire/tracetop_pb2*.py from tracetop/wire/tracetop.proto.

Usage: python scripts/gen_proto.py [--out DIR]
With --out, writes the generated files there instead (the drift test compares the two).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "tracetop/wire/tracetop.proto"
GENERATED = ("tracetop_pb2.py", "tracetop_pb2.pyi", "tracetop_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(ROOT / PROTO)]
        rc = protoc.main(args)
        if rc != 0:
            sys.exit(f"gen_proto: protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copyfile(Path(tmp) / "tracetop" / "wire" / name, out_dir / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tracetop" / "wire")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
