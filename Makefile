# `make test` and `make demo` do all the set-up a fresh machine needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/demo

.PHONY: setup test lint demo check bench clean

setup: $(STAMP)

# The venv sees the interpreter's own packages, so a torch the user already has (CUDA or not) is kept;
# only when there is none do we install the pinned CPU build (never a multi-GB CUDA wheel by accident).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

test: lint
	$(BIN)/python -m pytest -q

# The main job on built-in real data: plan, then train both runnable recipes (about two minutes on 2 CPU cores).
demo: $(STAMP)
	$(BIN)/reproduce plan papers/digits-mlp.yaml --micro-batch-max 32
	$(BIN)/reproduce run papers/digits-mlp.yaml --micro-batch-max 32 --out $(RUN_DIR)/digits-mlp --force
	$(BIN)/reproduce plan papers/pysource-gpt.yaml --micro-batch-max 16
	$(BIN)/reproduce run papers/pysource-gpt.yaml --micro-batch-max 16 --out $(RUN_DIR)/pysource-gpt --force
	@echo "Results: $(RUN_DIR)/digits-mlp and $(RUN_DIR)/pysource-gpt (summary.json, metrics.jsonl, model.pt)"

# The reproduction checks in reproduce/ (plans, gradient equivalence, trained metrics, Goyal et al. in miniature).
check: $(STAMP)
	$(BIN)/reproduce check reproduce/ --junit runs/check/junit.xml --summary runs/check/summary.md

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
