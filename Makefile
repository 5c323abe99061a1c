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
	$(BIN)/lint-imports --no-cache

test: deps venv lint
	$(BIN)/pytest

demo: deps venv
	$(BIN)/python -m example_project.demo $(DEMO_ARGS)

# The benchmarks' peers (celery-once, celery-singleton) come with the bench extra.
$(BIN)/.bench-installed: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[dev,demo,bench]'
	@touch $@

# Every benchmark in bench/, then the header of docs/benchmarks.md (about 25 minutes on a quiet
# 2-core machine). BENCH_ARGS=--smoke: small sizes, to check the pipeline.
bench: deps venv $(BIN)/.bench-installed
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache build *.egg-info
