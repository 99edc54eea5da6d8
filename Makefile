# `make test` and `make demo` do all the set-up a fresh machine needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/demo

.PHONY: setup test lint demo check bench clean

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
	$(BIN)/pip install -q -e ".[dev,plots,datasets,tensorboard,exports]"
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
