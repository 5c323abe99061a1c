# The two commands a newcomer runs (see README): `make demo` and `make test`.
# Each installs what it needs: Debian packages (as root) and a virtualenv in .venv.

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: all deps venv lint test test-fast demo bench clean

all: test

deps:
	@bash scripts/install-deps.sh

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,demo]'
	@touch $@

venv: $(BIN)/.installed

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: deps venv lint
	$(BIN)/pytest

demo: deps venv
	$(BIN)/python -m example_project.demo $(DEMO_ARGS)

bench: deps venv
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/recovery.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache build *.egg-info
