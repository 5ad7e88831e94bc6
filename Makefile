# learnmesh — the two commands a newcomer needs are `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run compose-secrets test test-fast conformance check lint typecheck bench-gateway bench-context bench-wait bench-inference \
        bench-trainer bench-delta bench-learning bench-mesh bench-drills clean deploy-tools check-deploy \
        conformance-proxy bench-proxy

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

## Set up and run the whole mesh on one machine (embedded default).
run: $(STAMP)
	$(BIN)/learnmesh up

## Every secret of the docker compose stack, generated once into compose/secrets.env (0600).
compose-secrets: $(STAMP)
	$(BIN)/learnmesh compose-secrets --out compose/secrets.env

## Test processes: 2 when each can start its own Redis (a private server and cluster per process);
## 1 against a shared one (LEARNMESH_TEST_REDIS_URL / _CLUSTER_URL, or no redis-server on PATH),
## which every test flushes. `make test TEST_JOBS=1` runs them one at a time.
TEST_JOBS ?= $(if $(shell command -v redis-server),$(if $(LEARNMESH_TEST_REDIS_URL)$(LEARNMESH_TEST_REDIS_CLUSTER_URL),1,2),1)

## All tests, then the official MCP conformance suite on both revisions (directly, and through
## the proxy to an upstream that speaks only 2025-11-25, then only 2026-07-28).
test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 -n $(if $(filter 1,$(TEST_JOBS)),0,$(TEST_JOBS))
	bash scripts/conformance.sh
	THROUGH_PROXY=2025-11-25 bash scripts/conformance.sh
	THROUGH_PROXY=2026-07-28 bash scripts/conformance.sh

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -p no:cacheprovider

conformance: $(STAMP)
	bash scripts/conformance.sh

conformance-proxy: $(STAMP)
	THROUGH_PROXY=2025-11-25 bash scripts/conformance.sh
	THROUGH_PROXY=2026-07-28 bash scripts/conformance.sh

lint: $(STAMP)
	$(BIN)/ruff check gateway services shared tests bench conformance

typecheck: $(STAMP)
	$(BIN)/mypy gateway services shared

check: lint typecheck test

bench-gateway: $(STAMP)
	$(BIN)/python bench/bench_gateway.py $(ARGS)

## The store's target setting: 10,000 principals, 4 and 64 callers (ARGS=... for more, e.g. --ops 30000;
## bench/bench_context.py alone is the short run on 300 principals).
bench-context: $(STAMP)
	$(BIN)/python bench/bench_context.py --full $(ARGS)

bench-wait: $(STAMP)
	$(BIN)/python bench/bench_wait.py $(ARGS)

bench-inference: $(STAMP)
	$(BIN)/python bench/bench_inference.py $(ARGS)

bench-trainer: $(STAMP)
	$(BIN)/python bench/bench_trainer.py $(ARGS)

bench-delta: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/bench_delta.py $(ARGS)

## Teach 10 made-up facts through learn on a whole mesh with the shipped defaults; answers and losses.
bench-learning: $(STAMP)
	$(BIN)/python bench/bench_learning.py $(ARGS)

bench-mesh: $(STAMP)
	$(BIN)/python bench/bench_mesh.py $(ARGS)

## The proxy: proxied tools/call vs the upstream directly vs FastMCP's proxy. FastMCP runs from its
## own venv (.venv-bench-proxy) so the test venv keeps its pins; wrk: apt-get install -y wrk.
BENCH_PROXY_VENV := .venv-bench-proxy
$(BENCH_PROXY_VENV)/.installed:
	test -x $(BENCH_PROXY_VENV)/bin/python || $(PY) -m venv $(BENCH_PROXY_VENV)
	$(BENCH_PROXY_VENV)/bin/pip install -q 'fastmcp==4.2.3' 'mcp==2.3.0' uvicorn uvloop httptools
	touch $@

bench-proxy: $(STAMP) $(BENCH_PROXY_VENV)/.installed
	$(BIN)/python bench/bench_proxy.py --fastmcp-python $(BENCH_PROXY_VENV)/bin/python $(ARGS)

## Fault drills (kill -9 worker/trainer, Redis restart, gateway replica, tampered deltas), long form.
## `make bench-drills ARGS=--cluster`: on a local Redis Cluster (3 masters + 3 replicas), where the
## Redis drill kills a master under load (failover, no acknowledged append lost).
bench-drills: $(STAMP)
	$(BIN)/python bench/drills.py $(ARGS)

## The tools that check deploy/ (kubernetes-validate, checkov), in their own venv.
DEPLOY_VENV := .venv-deploy
$(DEPLOY_VENV)/.installed: deploy/requirements.txt
	test -x $(DEPLOY_VENV)/bin/python || $(PY) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/pip install -q -r deploy/requirements.txt
	touch $@

deploy-tools: $(DEPLOY_VENV)/.installed

## Render the Kubernetes overlays and check them (kubectl kustomize, kubernetes-validate, checkov) and compose/.
check-deploy: $(STAMP) deploy-tools
	LEARNMESH_REQUIRE_DEPLOY_TOOLS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_deploy_kubernetes.py \
		tests/test_compose.py

clean:
	rm -rf $(VENV) $(DEPLOY_VENV) $(BENCH_PROXY_VENV) var node_modules .pytest_cache
