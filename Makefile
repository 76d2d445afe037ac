# The two commands of the README. Each sets up .venv first if needed (scripts/setup.sh).
.PHONY: run test setup

PY := .venv/bin/python

setup:
	@./scripts/setup.sh

# The OpenAI-compatible service on http://127.0.0.1:8000 (Ctrl-C stops it and Ray).
run: setup
	.venv/bin/serve run app:deployment

test: setup
	$(PY) -m pytest -q
