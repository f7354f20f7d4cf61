# The two commands a newcomer runs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-requirements
NPROC ?= 2

.PHONY: demo test test-all test-gpu setup clean-demo

setup: $(STAMP)

# Re-installs only when the requirements change, so a second `make test` starts at once. The
# project itself is installed editable: `shardface` and its tools work from any folder in the venv.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	$(PY) -c "from shardface.dataset.images import check_torchvision; check_torchvision()"
	@touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

# Includes the checks marked slow (several minutes more).
test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow" tests

# The GPU kit (tests marked gpu, on one GPU): train smoke runs, NCCL, TF32, host syncs, streams.
# On a GPU machine without internet whose python already has torch: make test-gpu PY=python3 GPU_SETUP=
GPU_SETUP ?= $(STAMP)
test-gpu: $(GPU_SETUP)
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: no CUDA device here')"
	$(PY) -m pytest -q -m gpu -rs tests

demo: $(STAMP)
	$(PY) -m scripts.demo --nproc $(NPROC)

clean-demo:
	rm -rf data/drawn_faces work_dirs/demo
