# The two commands of the README: `make demo` (the main job) and `make test` (the whole suite).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test venv k8s node lint format cluster-up cluster-down demo-down

venv:
	@bash scripts/bootstrap.sh

k8s:
	@bash tests/cluster/build-k8s.sh
	@bash tests/cluster/build-crd-server.sh

# the real node's kubelet, container packages and images (tests/test_real_node.py); cached after the first run
node: venv k8s
	@bash tests/cluster/build-node.sh
	@PYTHON=$(PY) bash tests/cluster/build-images.sh

demo: venv k8s
	@$(PY) scripts/demo.py

demo-down:
	@$(PY) -m tests.cluster.stack down --dir $${SPYRE_DEMO_DIR:-/tmp/spyre-serve-demo}

test: venv k8s node
	@echo "[test] ruff, import contracts, then pytest"
	@$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	@$(VENV)/bin/lint-imports
	@$(PY) -m pytest $(PYTEST_ARGS)

lint:
	@$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format:
	@$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

cluster-up: venv k8s
	@$(PY) -m tests.cluster up

cluster-down:
	@$(PY) -m tests.cluster down
