# The two commands of the README: `make demo` (the main job) and `make test` (the whole suite).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# test modules run side by side in this many processes (pytest-xdist; a module stays in one process, so its
# shared server is made once, and the modules of the session control plane share one process and one plane:
# tests/conftest.py's work_unit); 1 runs them one after another. Three on two cores: two kept
# the cores about 80 % busy, three 93 % (much of a test's time is waiting on a control plane, a kubelet or a
# server start). Four filled the cores (fresh clone, 2026-11-27: 18 min 17 s, then 22 min 50 s) and starved the
# control plane: a test operator's 6 s Lease went unrenewed behind a 2 s API timeout and a test failed
PYTEST_WORKERS ?= 3

.PHONY: demo test venv k8s node prometheus lint format docs cluster-up cluster-down demo-down

venv:
	@bash scripts/bootstrap.sh

k8s:
	@bash tests/cluster/build-k8s.sh
	@bash tests/cluster/build-crd-server.sh

# promtool and prometheus from Debian's package (the alert rules' unit tests); cached after the first run
prometheus:
	@bash tests/cluster/build-prometheus.sh

# the real node's kubelet, container packages and images (tests/test_real_node.py); cached after the first run
node: venv k8s
	@bash tests/cluster/build-node.sh
	@PYTHON=$(PY) bash tests/cluster/build-images.sh

# NODE=podrunner (default): pods as local processes, quick; NODE=kubelet: a real node runs the images
NODE ?= podrunner

demo: venv k8s
	@if [ "$(NODE)" = kubelet ]; then $(MAKE) --no-print-directory node; fi
	@SPYRE_DEMO_NODE=$(NODE) $(PY) scripts/demo.py

demo-down:
	@$(PY) -m tests.cluster.stack down --dir $${SPYRE_DEMO_DIR:-/tmp/spyre-serve-demo}

test: venv k8s node prometheus
	@echo "[test] ruff, import contracts, the docs site (mkdocs build --strict), then pytest"
	@$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	@$(VENV)/bin/lint-imports
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site
	@# the C++ kernels' whole build, once, in torch's shared folder: every test's server then loads it, where
	@# a server that found none would build its own dtypes' paths (runtime/.../kernels/paged_attention.py)
	@$(PY) -m spyre_runtime.executor.kernels.paged_attention
	@OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint:
	@$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format:
	@$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# the SpyreModel API reference from the CRD, then the site (build/site)
docs: venv
	@$(PY) scripts/crd_reference.py
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

cluster-up: venv k8s
	@$(PY) -m tests.cluster up

cluster-down:
	@$(PY) -m tests.cluster down
