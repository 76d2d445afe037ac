#!/usr/bin/env bash
# Run the Triton kernel tests under the interpreter with other Triton releases, to check the
# floor pyproject.toml declares (triton>=3.4) and the GPU machine's release (3.6).
#   scripts/check_triton_versions.sh 3.4.0 3.6.0
# Each release gets a venv under .cache/triton-venvs/<version> (about 0.6 GB; needs the
# network once) holding that triton and numpy<2.3 (these releases' interpreters turn
# one-element arrays into loop bounds with int(), which NumPy 2.3 refuses), and sees
# everything else through .venv. Exit status: the number of releases whose tests failed.
set -u
cd "$(dirname "$0")/.." || exit 1
[ -x .venv/bin/python ] || { echo "check_triton_versions: run scripts/setup.sh first" >&2; exit 1; }
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tests=(tests/kernels/test_triton_paged_attention.py tests/kernels/test_triton_store_kv.py
       tests/kernels/test_attention_dispatch_sdpa.py)
failed=0
for version in "$@"; do
  venv=.cache/triton-venvs/$version
  if [ ! -x "$venv/bin/python" ]; then
    .venv/bin/python -m venv --without-pip "$venv" || exit 1
    .venv/bin/pip --python "$venv/bin/python" install --quiet --no-deps "triton==$version" "numpy<2.3" || exit 1
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$site" > "$own/main-venv.pth"  # after the venv's own triton and numpy on sys.path
  fi
  echo "== triton $("$venv/bin/python" -c 'import triton; print(triton.__version__)')"
  TRITON_INTERPRET=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tail -n 1
  [ "${PIPESTATUS[0]}" = 0 ] || failed=$((failed + 1))
done
exit "$failed"
