# The two commands of the README, and their parts. Each sets up .venv first if needed
# (scripts/setup.sh).
.PHONY: run test test-fast lint setup

PY := .venv/bin/python

setup:
	@./scripts/setup.sh

# The OpenAI-compatible service on http://127.0.0.1:8000: `serve run app:deployment`, which
# Ctrl-C or SIGTERM stops cleanly, with Ray (scripts/serve_run.py).
run: setup
	.venv/bin/python scripts/serve_run.py app:deployment

# Everything CI runs: the whole suite, with the slowest tests' durations printed.
test: setup
	$(PY) -m pytest -q

# Unit tests only (no served app, no subprocess benchmarks): a few minutes.
test-fast: setup
	$(PY) -m pytest -q -m "not e2e and not slow"

lint: setup
	.venv/bin/ruff check .
