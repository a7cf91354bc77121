PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= train_configs/debug_moe.toml

.PHONY: train test test-all lint format venv clean gpu-check

# The pinned runtime requirements (pyproject.toml), pytest and ruff (the dev extra), the moevement-lm-eval command
# (which runs this checkout's code: nothing of the project is installed as a package, pyproject.toml).
$(VENV)/.installed: pyproject.toml eval/moevement-lm-eval
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet ".[dev]"
	touch $@

venv: $(VENV)/.installed

# The product's main job: two pipeline stages under torchrun with MoEvement sparse checkpointing;
# rank 1 (stage 1) SIGKILLs itself at iteration 30; its rank shell's standby takes its place while rank 0's
# process lives on, and stage 1 recovers alone from its neighbour's logs (torchrun's restart: the fallback).
train: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 1 \
		train.py --config $(CONFIG) --parallelism.pp 2 --checkpoint.strategy moevement --fault.kill 30:1:backward

# One machine with one NVIDIA GPU, under 9 minutes: CUDA numerics, MoEvement snapshots and recovery on CUDA,
# a 16B-shaped stage's MFU, collectives of two processes sharing the GPU (benchmarks/gpu_check/).
gpu-check: $(VENV)/.installed
	$(PY) -m benchmarks.gpu_check

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

test-all: $(VENV)/.installed
	$(PY) -m pytest -q --runslow tests

clean:
	rm -rf $(VENV) outputs .pytest_cache build
