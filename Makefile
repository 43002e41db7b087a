# genserver: `make up` runs the whole service, `make test` runs the checks and the tests.
# Both create .venv and install requirements.txt (the service) and requirements-dev.txt
# (tests, benchmarks, lint and type checks) when missing or changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: up test lint pytest workers bench clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

up: $(VENV)/.installed
	$(PY) -m workers.stack

# Lint, format, layers and types first (seconds), then the suite (minutes).
test: lint pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The suite runs in PYTEST_WORKERS pytest-xdist workers (0: in this process alone), each with its own database,
# Redis database and stack (tests/support/parallel.py). More workers share the same cores: most of a stack test is
# waiting on its workers, so two on 2 cores take about half the time of one; more gain little and load the timing.
PYTEST_WORKERS ?= 2
# pytest's status 5 (no test collected, e.g. a mistyped PYTEST_ARGS) fails the run like any other.
pytest: $(VENV)/.installed
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist load $(PYTEST_ARGS) || { status=$$?; [ $$status -ne 5 ] || echo "pytest collected no tests" >&2; exit $$status; }

workers: $(VENV)/.installed
	$(PY) -m workers.launcher

bench: $(VENV)/.installed
	$(PY) -m bench.seed_table

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
