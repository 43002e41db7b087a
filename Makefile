# genserver: `make up` runs the whole service, `make test` runs the tests.
# Both create .venv and install requirements.txt when missing or changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: up test workers bench clean

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

up: $(VENV)/.installed
	$(PY) -m workers.stack

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

workers: $(VENV)/.installed
	$(PY) -m workers.launcher

bench: $(VENV)/.installed
	$(PY) -m bench.seed_table

clean:
	rm -rf var .pytest_cache
