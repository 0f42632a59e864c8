# staleopt — the two commands a fresh machine needs: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# `make test` adds the test extras (pytest, ray, notebook runners) on top; `make demo` needs none of them.
TESTSTAMP := $(VENV)/.installed-test
# Torch is pinned here (not in setup.cfg): these wheels are known to work together.
TORCH   := torch==2.14.1 torchvision==0.29.1
THREADS ?= 2

.PHONY: install test demo bench reproduce reproduce-ladder notebooks clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TESTSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $(TESTSTAMP)

test: $(TESTSTAMP)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/staleopt demo --out runs/demo

bench: install
	$(BIN)/python experiments/bench_overhead.py --out runs/bench
	$(BIN)/python experiments/bench_data.py --out runs/bench_data

# The ledger's quick tier (every check at its recipe's length; the page goes beside the
# runs), and the full ladder of run lengths that docs/reproductions.md is generated from (resumable; its cost is
# printed before it starts). Both share runs/reproduce: the ladder reuses the quick tier's runs.
reproduce: install
	$(BIN)/staleopt reproduce --out runs/reproduce --doc runs/reproduce/reproductions.md

reproduce-ladder: install
	$(BIN)/staleopt reproduce --tier ladder --out runs/reproduce --doc docs/reproductions.md

# The notebooks executed in place, so that they are committed with their outputs (needs the test extra).
notebooks: $(TESTSTAMP)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python experiments/run_notebooks.py

clean:
	rm -rf $(VENV) runs *.egg-info
