#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels `tracetop bench gpu` needs on the device machine
# (Python 3.12, x86-64 manylinux, no network there) that its image lacks or holds in another
# version: the collector's duckdb and crc32c, grpcio/protobuf/nvidia-ml-py at the versions the
# generated code and the agent were tested with, and DeepSpeed with its missing dependencies.
# DeepSpeed is an sdist on PyPI: it is built here into a py3 wheel (no compiled ops, DS_BUILD_OPS=0).
# Run from the repository root: scripts/prepare_gpu_wheels.sh   (prints the total size; limit 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
rm -f .whl/*.whl
# one version of each; these are the versions .venv was tested with
BINARY=(duckdb==2.0.1 crc32c==2.9.post0 grpcio==1.85.3 protobuf==7.36.2 nvidia-ml-py==13.615.71
        hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typing-extensions==4.16.0)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${BINARY[@]}"
# --no-build-isolation: DeepSpeed's setup.py imports torch; the CPU torch of .venv serves, no CUDA build pulled
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -l .whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "prepare_gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in .whl/ (the device takes 64 MiB with the tree)"
