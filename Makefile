PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= train_configs/debug_moe.toml

.PHONY: train test test-all venv clean

$(VENV)/.installed: requirements.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

venv: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) train.py --config $(CONFIG)

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

test-all: $(VENV)/.installed
	$(PY) -m pytest -q --runslow tests

clean:
	rm -rf $(VENV) outputs .pytest_cache
