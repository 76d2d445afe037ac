# The two commands of the README, and their parts. Each sets up .venv first if needed
# (scripts/setup.sh).
.PHONY: run test test-fast lint setup

PY := .venv/bin/python

setup:
	@./scripts/setup.sh

# The OpenAI-compatible service on http://127.0.0.1:8000 (Ctrl-C stops it and Ray): the
# defaults and MINI_INFER_* variables, with Serve's HTTP timeouts (ray_configs/serve_local.yaml).
run: setup
	.venv/bin/serve run ray_configs/serve_local.yaml

# Everything CI runs: the whole suite, with the slowest tests' durations printed.
test: setup
	$(PY) -m pytest -q

# Unit tests only (no served app, no subprocess benchmarks): a few minutes.
test-fast: setup
	$(PY) -m pytest -q -m "not e2e and not slow"

lint: setup
	.venv/bin/ruff check .
