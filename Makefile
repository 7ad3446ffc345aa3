# Set-up is two commands on a fresh machine:  `make demo`  and  `make test`.
# `make demo` installs only what the demo needs (ckptaudit and the pinned torch); `make test` adds the test stack.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
DEMO_STAMP := $(VENV)/.demo-installed
STAMP   := $(VENV)/.installed

.PHONY: demo test lint typecheck unit unit-reversed bench clean

$(DEMO_STAMP): pyproject.toml constraints.txt
	@echo "== [1/2] creating $(VENV) (Python: $(PY))"
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "== [2/2] installing ckptaudit with torch 2.13.0 (CPU build, pinned by constraints.txt: about 200 MB)"
	$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e '.[torch]'
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	@echo "== [1/3] the test stack: transformers, accelerate, Lightning, PEFT, Megatron-Core, moto, pytest, ruff, mypy"
	$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e '.[test]'
	# The training stacks the tests write real checkpoints with. DeepSpeed is an sdist whose build imports torch
	# (no build isolation, no prebuilt ops: it JIT-builds one small op with g++ at first use); torchtitan 0.3.0
	# pins packages it does not need for checkpoints (wandb, tensorboard, datasets): installed without them.
	@echo "== [2/3] DeepSpeed (built from its sdist without its ops: a minute or two)"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation -c constraints.txt deepspeed
	@echo "== [3/3] torchtitan and its few checkpoint dependencies"
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt torchtitan
	$(BIN)/python -m pip install --quiet -c constraints.txt tyro torchdata spmd_types
	touch $(STAMP)

demo: $(DEMO_STAMP)
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
