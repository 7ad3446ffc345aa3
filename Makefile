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
	@echo "== [1/4] the test stack: transformers, accelerate, Lightning, PEFT, Megatron-Core, moto, a GCS emulator, pytest, ruff, mypy"
	$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e '.[test]'
	# The training stacks the tests write real checkpoints with. DeepSpeed is an sdist whose build imports torch
	# (no build isolation, no prebuilt ops: it JIT-builds one small op with g++ at first use); torchtitan 0.3.0
	# pins packages it does not need for checkpoints (wandb, tensorboard, datasets): installed without them.
	@echo "== [2/4] DeepSpeed (built from its sdist without its ops: a minute or two)"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation -c constraints.txt deepspeed
	@echo "== [3/4] torchtitan and its few checkpoint dependencies"
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt torchtitan
	$(BIN)/python -m pip install --quiet -c constraints.txt tyro torchdata spmd_types
	@echo "== [4/4] Chromium (Debian's package) for the HTML report's browser test, when missing"
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) || \
	      echo "   chromium could not be installed: tests/report/test_html_browser.py will skip"; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    (sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) || \
	      echo "   chromium could not be installed: tests/report/test_html_browser.py will skip"; \
	  else \
	    echo "   no chromium and no root to install it (apt-get install chromium): the browser test will skip"; \
	  fi
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/ckptaudit demo --out ckptaudit-demo

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# The suite runs its test files on TEST_WORKERS processes (pytest-xdist; a file's tests stay together, in order, on
# one worker; library checkpoints are still written once per run: tests/support/shared_fixtures.py).
# TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)

unit: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST)

# The suite with its files in reversed order (CKPTAUDIT_TEST_ORDER=random or random:SEED shuffles them instead):
# no test may pass only because another file ran first.
unit-reversed: $(STAMP)
	CKPTAUDIT_TEST_ORDER=reverse $(BIN)/python -m pytest -q $(XDIST)

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python bench/bench_scan.py

clean:
	rm -rf $(VENV) ckptaudit-demo .pytest_cache .mypy_cache .ruff_cache
