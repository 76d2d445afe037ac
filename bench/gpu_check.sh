#!/usr/bin/env bash
# GPU check, for a CUDA machine, in under 8 minutes:
#   (a) the kernel tests on the GPU (no TRITON_INTERPRET),
#   (b) decode paged attention: Triton vs gather-then-SDPA, GB/s against copy bandwidth,
#   (c) the fixed workload w1_mixed through the engine with both attention backends.
# Everything is merged into bench/results/gpu_check-<YYYY-MM-DD>.json. A part that fails or
# times out is recorded as such; the others still run.
# Without CUDA it says so and exits 0.
set -u
cd "$(dirname "$0")/.." || exit 1

PY=python
[ -x .venv/bin/python ] && PY=.venv/bin/python

if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  echo "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is false here); nothing to do."
  exit 0
fi
unset TRITON_INTERPRET

DATE=$(date +%F)
OUT="bench/results/gpu_check-$DATE.json"
PARTS=$(mktemp -d)
DEADLINE=$(( $(date +%s) + 460 ))  # leaves ~20 s of the 8 minutes for start-up and merge

# run_part NAME BUDGET_S CMD...: run CMD under `timeout`, capped by the time left before
# DEADLINE; log to $PARTS/NAME.log, exit status to $PARTS/NAME.rc (124: timed out).
run_part() {
  local name=$1 budget=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  (( budget > left )) && budget=$left
  if (( budget < 10 )); then
    echo "gpu_check: no time left for $name"; echo 124 > "$PARTS/$name.rc"; return
  fi
  echo "gpu_check: $name (up to ${budget}s)"
  timeout --kill-after=10 "$budget" "$@" > "$PARTS/$name.log" 2>&1
  echo $? > "$PARTS/$name.rc"
  tail -n 3 "$PARTS/$name.log"
}

run_part pytest 150 "$PY" -m pytest tests/kernels -q -p no:cacheprovider
run_part kernel_bench 110 "$PY" bench/kernel_bench.py bench --json-out "$PARTS/kernel_bench.json"
for backend in triton torch; do
  run_part "engine_$backend" 95 "$PY" -m engine generate \
    --workload ../shared/workloads/w1_mixed.json --model dummy:qwen2.5-7b --dtype bfloat16 \
    --attention-backend "$backend" --json-out "$PARTS/engine_$backend.json"
done

"$PY" bench/kernel_bench.py merge --dir "$PARTS" --out "$OUT" --date "$DATE"
cat "$PARTS/kernel_bench.log" 2>/dev/null | tail -n 20
rm -rf "$PARTS"
