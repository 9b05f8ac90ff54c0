# vramshare developer entry points. `make test` and `make demo` set up everything from nothing.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The virtualenv is rebuilt when pyproject.toml changes.
VENV_STAMP := $(VENV)/.installed-$(shell cat pyproject.toml e2e/pyproject.toml | sha256sum | cut -c1-12)

.PHONY: help
help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(VENV_STAMP): pyproject.toml e2e/pyproject.toml
	@echo "[vramshare] setting up $(VENV) (Python dependencies)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	@$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]' -e ./e2e
	@rm -f $(VENV)/.installed-* && touch $@

.PHONY: venv
venv: $(VENV_STAMP) ## Create the virtualenv and install vramshare with its dev tools

.PHONY: tools
tools: venv ## Build (once, cached) etcd, Kubernetes, kwok and helm from their Go modules; install Prometheus
	@$(BIN)/python -m vramshare_e2e.cli --prepare

.PHONY: node-image
node-image: venv ## Build (when the code changed) the image for real nodes: make image's, exported as an OCI archive
	@$(BIN)/python -m vramshare_e2e.image

.PHONY: airflow
airflow: ## Install (once, cached) the real Apache Airflow 3 and 2 the Airflow tests run, each in its own virtualenv
	@bash e2e/tools/airflow.sh airflow >/dev/null
	@bash e2e/tools/airflow.sh airflow2 >/dev/null

.PHONY: lint
lint: venv ## ruff (lint and format check)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

.PHONY: typecheck
typecheck: venv ## mypy --strict
	$(BIN)/mypy

.PHONY: contracts
contracts: venv ## import-linter: the domain stays pure
	$(BIN)/lint-imports

.PHONY: unit
unit: venv ## Fast tests: no I/O, without the slow ones (SLOW=1: with them; make test runs them all)
	$(BIN)/pytest tests/unit $(if $(SLOW),,-m "not slow")

# Test modules run on this many workers (pytest-xdist), each module whole on one worker: most of an
# integration module's time is spent waiting on its control plane, so two overlap well even on 2 cores.
TEST_WORKERS ?= 2

.PHONY: test
test: venv tools node-image airflow browser lint typecheck contracts docs ## Everything: lint, types, contracts, the manual, unit, integration, e2e
	$(BIN)/pytest --numprocesses=$(TEST_WORKERS) --dist=loadfile

.PHONY: docs
docs: venv ## The manual: docs/ built into site/ by MkDocs, strict (a broken link, anchor or stale reference page fails)
	$(BIN)/python -m vramshare_e2e.reference_docs --check
	$(BIN)/python -m vramshare_e2e.docs_site

.PHONY: docs-reference
docs-reference: venv ## Regenerate the manual's reference pages (settings, metrics, CRDs, chart values) from the code
	$(BIN)/python -m vramshare_e2e.reference_docs

.PHONY: browser
browser: venv ## Install Debian's Chromium where missing, for the manual's browser test
	@$(BIN)/python -m vramshare_e2e.docs_site --chromium

.PHONY: demo
demo: venv tools $(if $(REAL_NODE),node-image,) ## The whole system on a local control plane: pods admitted, placed, refused (KEEP=1 keeps it up; REAL_NODE=1: the chart on real nodes)
	$(BIN)/python -m vramshare_e2e.demo $(if $(FAST),--fast,) $(if $(REAL_NODE),--real-node,)

.PHONY: bench-admission
bench-admission: venv tools ## Pod creation through vramshare vs a no-webhook baseline; decision cost curve
	$(BIN)/python -m vramshare_e2e.bench_admission --out bench/results

.PHONY: image
image: ## Build the image with buildah on a Debian-package base, run each entry point in it, report its size
	bash e2e/tools/build-image.sh

.PHONY: plugin
plugin: venv ## The kubectl plugin as krew ships it: dist/kubectl-vramshare-v<version>.tar.gz and its manifest dist/vramshare.yaml
	$(BIN)/python -m vramshare_e2e.plugin --out dist

.PHONY: chart-docs
chart-docs: venv ## Regenerate charts/vramshare/README.md from the comments in values.yaml
	$(BIN)/python -m vramshare_e2e.chart_docs

.PHONY: bench-controller
bench-controller: venv tools ## What 5000 churning ordinary pods cost the controller (CPU, memory, Lease, release and expiry lag) vs none
	$(BIN)/python -m vramshare_e2e.bench_controller --out bench/results

.PHONY: bench-fleet
bench-fleet: venv tools ## A 1000-GPU fleet (125 kwok nodes x 8) with 10 000 bookings: poll time, writes per poll, admission, memory
	$(BIN)/python -m vramshare_e2e.bench_fleet --out bench/results

.PHONY: bench-packing
bench-packing: venv ## Packing quality of vramshare vs Kaapana-like, whole-GPU and time-slicing (simulated)
	$(BIN)/python -m vramshare_e2e.bench_packing --out bench/results

.PHONY: reliability
reliability: venv tools ## The adversarial suite at larger sizes (RELIABILITY_PODS, RELIABILITY_FUZZ_CASES)
	RELIABILITY_PODS=$${RELIABILITY_PODS:-1000} RELIABILITY_FUZZ_CASES=$${RELIABILITY_FUZZ_CASES:-5000} \
		$(BIN)/pytest -s tests/reliability

.PHONY: cluster
cluster: venv tools ## Run the local control plane in the foreground (Ctrl-C stops it)
	$(BIN)/python -m vramshare_e2e.cli

.PHONY: sync-crds
sync-crds: ## Copy crds/ into the chart (a test fails while they differ)
	cp crds/*.yaml charts/vramshare/crds/

.PHONY: fmt
fmt: venv ## Format the code
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

.PHONY: clean
clean: ## Remove the virtualenv and caches in the repo (the built tools cache stays)
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis .import_linter_cache
