# `make test` and `make demo` do all the set-up a fresh machine needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/demo

.PHONY: setup test test-core lint demo check docs-check bench clean

setup: $(STAMP)

# The venv sees the interpreter's own packages, so a torch the user already has (CUDA or not) is kept.
# With none, torch 2.14.1 + torchvision 0.29.1, the pair that imports together here (PyPI's torchvision does not
# import beside the 2.13.0 CPU build; see the README). With a torch but no torchvision, the torchvision built for
# that torch's release is tried, and removed again if it does not import (image data and ResNet-50 then say so).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.14.1" "torchvision==0.29.1"
	$(BIN)/python -c "import torchvision" 2>/dev/null || { \
	  $(BIN)/pip install -q --no-deps "torchvision==$$($(BIN)/python -c 'import torch; print("0.%d.*" % (int(torch.__version__.split(".")[1]) + 15))')" \
	  && $(BIN)/python -c "import torchvision" 2>/dev/null; } || { $(BIN)/pip uninstall -q -y torchvision; \
	  echo "warning: no torchvision imports beside this torch: image folders and resnet50 are unavailable"; }
	$(BIN)/pip install -q -e ".[dev,plots,datasets,tensorboard,exports,wandb,mlflow,quantize]"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

# PYTEST_ARGS: pytest's arguments, e.g. make test PYTEST_ARGS=tests/e2e/test_shipped_checks.py (default: every test
# of tests/: core/, torch/<package>/, cli/, e2e/; the slow ones only with PYTEST_ARGS="-m slow"). TEST_WORKERS:
# pytest-xdist's processes (2, CI's cores; 0 runs every test in this one process).
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 $(PYTEST_ARGS)

# The torch-free core's tests alone (tests/core/: planner, recipe validation, overrides, the probe's search, the
# code's layering): seconds, no lint; the session fails if any of them imports torch (tests/core/conftest.py).
test-core: $(STAMP)
	$(BIN)/python -m pytest -q tests/core $(PYTEST_ARGS)

# The whole chain on a CPU in a few minutes, nothing downloaded: (1) probe the micro-batch of the built-in GPT
# under a small declared memory, as if on a small GPU; (2) plan from it and run that plan; (3) a published paper
# planned for a common GPU with the estimate meter; (4) verify the plan of (2); (5) a run on an on-disk format;
# (6) gates: a wrong learning rate paused at the first gate (exit 4), then the fixed run passing them all.
demo: $(STAMP)
	@start=$$(date +%s); set -e; \
	echo; echo "== 1. probe: the largest micro-batch of the built-in GPT whose training step fits 32 MiB (cpu meter)"; \
	$(BIN)/reproduce probe papers/pysource-gpt.yaml --meter cpu --memory 32MiB --no-cache; \
	echo; echo "== 2. plan from the probe (exact: m x N = the recipe's 64 sequences), then the run that uses it"; \
	$(BIN)/reproduce plan papers/pysource-gpt.yaml --meter cpu --memory 32MiB --out $(RUN_DIR)/pysource-gpt.plan.yaml; \
	$(BIN)/reproduce run $(RUN_DIR)/pysource-gpt.plan.yaml --out $(RUN_DIR)/pysource-gpt --force; \
	echo; echo "== 3. a paper planned for a GPU you may not have: Goyal et al.'s ResNet-50 on an RTX 4090 (estimate meter)"; \
	$(BIN)/reproduce plan papers/goyal2017-resnet50.yaml --gpu rtx4090; \
	echo; echo "== 4. verify: the plan's accumulated gradient against the one-pass gradient of the same 64 sequences"; \
	$(BIN)/reproduce verify $(RUN_DIR)/pysource-gpt.plan.yaml; \
	echo; echo "== 5. data on disk: the digits written as PNG class folders, read by DataLoader workers"; \
	$(BIN)/python -m reproduce.data.samples images $(RUN_DIR)/data/digits-png; \
	$(BIN)/reproduce run papers/digits-imagefolder.yaml --micro-batch-max 32 --out $(RUN_DIR)/digits-imagefolder --force \
	  --data $(RUN_DIR)/data/digits-png/train --eval-data $(RUN_DIR)/data/digits-png/val; \
	echo; echo "== 6. gates: the digits recipe's targets, checked as it runs; a learning rate 100x too small pauses at the first (exit 4)"; \
	$(BIN)/reproduce run papers/digits-mlp.yaml --micro-batch-max 32 --out $(RUN_DIR)/gates --force \
	  --set optimizer.lr=0.002 --set schedule.warmup.start_lr=0.0002 || test $$? -eq 4; \
	echo "-- the fix (the recipe's own learning rate), run again: every gate passes"; \
	$(BIN)/reproduce run papers/digits-mlp.yaml --micro-batch-max 32 --out $(RUN_DIR)/gates --force; \
	echo; echo "demo done in $$(( $$(date +%s) - start )) s; outputs in $(RUN_DIR)/"

# The reproduction checks in reproduce/ (plans, gradient equivalence, trained metrics, Goyal et al. in miniature).
check: $(STAMP)
	$(BIN)/reproduce check reproduce/ --junit runs/check/junit.xml --summary runs/check/summary.md

# Every `reproduce` command shown in README.md and docs/ run for real, its exit code against the docs' (minutes:
# full-size paper estimates among them); `make test` checks the same commands' options and files without running them.
docs-check: $(STAMP)
	$(BIN)/python tests/docs_commands.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
