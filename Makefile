# The two commands of the quickstart: `make demo` and `make test`. Both set up .venv if missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
export DS_ACCELERATOR := cpu
export OMP_NUM_THREADS := 1
export DS_BUILD_OPS := 0
export PYTHONUNBUFFERED := 1

.PHONY: setup external test test-fast demo lint proto clean

setup: $(VENV)/.ready external

# Alertmanager, promtool and tmux from apt where it is there (quick no-op once installed; never fatal).
external:
	bash scripts/setup_external.sh

# torch first and pinned: an unpinned torch (or deepspeed pulling one) installs a multi-GB CUDA build.
$(VENV)/.ready: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[trainer,dev,otlp]'
	touch $@

# Two workers, a test file each at a time (`--dist loadfile`: a module's fixture runs its real
# multi-process job once, on one worker): 30 -> 18.5 min on two cores, at load 4-6, the load every
# test must hold at (docs/development.md). `make test TEST_WORKERS=0` runs the suite in one process.
TEST_WORKERS ?= 2
PYTEST := $(VPY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

# ruff and mypy first (seconds), then the suite.
test: setup lint
	$(PYTEST) --durations=25

test-fast: setup
	$(PYTEST) -m 'not slow'

demo: setup
	$(VENV)/bin/tracetop demo

# ruff on the tree; mypy on the packages every rank runs (pyproject.toml [tool.mypy] names them).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

proto: setup
	$(VPY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) build *.egg-info
