#!/usr/bin/env bash
# The H200 runs behind bench/results/h200_compile_sweep (issue 20): the drafter step compiled against eager
# over the grid of bench/compile_sweep.py, the recompiles each planned batch pays, MFU, and Inductor probes.
# Needs .whl (pyzmq for python 3.12; see bench/h200_eval_regen_commands.sh). Each step has its own timeout
# and log under ${OUT:-/tmp/out}; TORCH_LOGS=recompiles goes to the logs, so every recompile names its guard.
# PART=diag: four sweeps side by side (compiles are CPU-bound, the GPU mostly idle; their step times are
# not the record): the Qwen3-1.7B shape as is and with EXTRA (an Inductor probe; by default without mix-order
# reductions, the pass whose size guards the warm-up logs show), the 8B and 27B shapes full.
# PART=record: the grid one shape at a time, nothing beside it (the recorded figures).
# PART=profile: the 27B step's kernel table, and the same with an Inductor probe (EXTRA).
# PART=ab: the 27B step on the same planned batches with the drafter's flex tiles, then Inductor's.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_LOGS=${TORCH_LOGS-recompiles}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/extra .whl/pyzmq*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/extra
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# CACHE=save: Inductor's cache (graphs, Triton kernels) comes back as $OUT/inductor_cache.tgz.part-* (the
# device returns files of 16 MiB at most); copy them into .inductor-cache/ here (git-ignored) and carry it, and
# the next call's warm-ups are warm (a cold 27B warm-up is ~150 s of a 10-minute call). Warm-up times are then
# warm ones; recompile counts and step times do not change. The device returns 8 files a call at most:
# save on a call with few result files (PART=steps of one shape writes 3).
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
if ls .inductor-cache/inductor_cache.tgz.part-* >/dev/null 2>&1; then
  cat .inductor-cache/inductor_cache.tgz.part-* | tar -xz -C "$TORCHINDUCTOR_CACHE_DIR" && echo "inductor cache: loaded"
fi
save_cache() {
  [ "${CACHE:-}" = save ] || return 0
  tar -cz -C "$TORCHINDUCTOR_CACHE_DIR" . | split -b 15M - "$OUT/inductor_cache.tgz.part-"
  echo "inductor cache: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1) in $(ls "$OUT"/inductor_cache.tgz.part-* | wc -l) part(s)"
}
trap save_cache EXIT
step() {  # step NAME SECONDS ARGS...: one sweep into $OUT/NAME, its console in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" python3 bench/compile_sweep.py --out "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: rc $? in $((SECONDS - t0)) s"
}
if [ "${PART:-diag}" = diag ]; then
  step base_1.7b 520 --shapes qwen3-1.7b &
  step probe_1.7b 520 --shapes qwen3-1.7b --modes full ${EXTRA:---inductor triton.mix_order_reduction=False} &
  step full_8b 520 --shapes qwen3-8b --modes full &
  step full_27b 520 --shapes qwen3.6-27b --modes full &
  wait
elif [ "$PART" = profile ]; then  # the 27B step: its kernels by GPU time, then a probe (EXTRA), alone
  step profile_27b 235 --shapes qwen3.6-27b --modes full --draws 4 --reference-every 0 --profile
  step probe_27b 235 --shapes qwen3.6-27b --modes full --draws 4 --reference-every 0 --profile \
    ${EXTRA:---inductor triton.mix_order_reduction=False}
elif [ "$PART" = ab ]; then  # the 27B step on the same batches with the drafter's flex tiles and Inductor's
  for tiles in drafter inductor; do
    step "ab_27b_$tiles" 250 --shapes qwen3.6-27b --modes full --draws "${DRAWS:-6}" --reference-every 0 \
      --profile --flex-tiles "$tiles" --seconds 40 ${EXTRA:-}
  done
elif [ "$PART" = record ]; then
  for shape in ${SHAPES:-qwen3-1.7b qwen3-8b llama3.1-8b head-dim-64 qwen3.6-27b}; do
    step "record_$shape" "${LIMIT:-280}" --shapes "$shape" --draws "${DRAWS:-5}" ${EXTRA:-}
  done
fi
# PART=steps: 500 planned batches at the launch defaults (token budget 4096, samples up to 3072 tokens),
# compiled full, checked against eager every 50th: the recompiles a run pays after its first step.
# Drawing stops WARMUP_S (default 200: a cold 27B warm-up plus start-up) before LIMIT, so the weight update
# is timed and the JSON saved; FIRST=K resumes the same plan at batch K in a later call (a fresh process
# pays its warm-up again, so a batch that compiles there counts even if an earlier one would have covered it).
if [ "${PART:-diag}" = steps ]; then
  for shape in ${SHAPES:-qwen3-8b qwen3.6-27b}; do  # PARALLEL=1: the shapes side by side (recompiles only)
    step "steps_$shape" "${LIMIT:-280}" --shapes "$shape" --modes full --draws "${DRAWS:-500}" \
      --reference-every "${EVERY:-50}" --budget 4096 --max-len 3072 --first-draw "${FIRST:-0}" \
      --seconds "$(( ${LIMIT:-280} - ${WARMUP_S:-200} ))" ${EXTRA:-} &
    [ "${PARALLEL:-0}" = 1 ] || wait
  done
  wait
fi
