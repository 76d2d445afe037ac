# The two commands of the README. Each sets up .venv first if needed (scripts/setup.sh).
.PHONY: run test setup

PY := .venv/bin/python

setup:
	@./scripts/setup.sh

run: setup
	$(PY) -m engine generate --prompt "What is the capital of France?"

test: setup
	$(PY) -m pytest -q
