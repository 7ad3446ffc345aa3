# Set-up is two commands on a fresh machine:  `make demo`  and  `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test lint typecheck unit unit-reversed bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	# The training stacks the tests write real checkpoints with. DeepSpeed is an sdist whose build imports torch
	# (no build isolation, no prebuilt ops: it JIT-builds one small op with g++ at first use); torchtitan 0.3.0
	# pins packages it does not need for checkpoints (wandb, tensorboard, datasets): installed without them.
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation -c constraints.txt deepspeed
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt torchtitan
	$(BIN)/python -m pip install --quiet -c constraints.txt tyro torchdata spmd_types
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ckptaudit demo --out ckptaudit-demo

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q

# The suite with its files in reversed order (CKPTAUDIT_TEST_ORDER=random or random:SEED shuffles them instead):
# no test may pass only because another file ran first.
unit-reversed: $(STAMP)
	CKPTAUDIT_TEST_ORDER=reverse $(BIN)/python -m pytest -q

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python bench/bench_scan.py

clean:
	rm -rf $(VENV) ckptaudit-demo .pytest_cache .mypy_cache .ruff_cache
