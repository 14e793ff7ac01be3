#!/usr/bin/env bash
# The H200 runs behind bench/results/h200_{cuda_tests,spec_eval_cost,regenerate_speed}: the CUDA-only tests
# (flash-linear-attention kernels in fp32 against HF per sample, flex packing, CUDA IPC), the real-eval cost
# per prompt, the regeneration speed, and a compiled sliding-window drafter on the GPU. Needs the wheels in
# .whl (pyzmq, flash-linear-attention, fla-core for python 3.12:
# pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl ...).
# PART=1: the fla test, real-eval cost, regeneration speed (~6 min); PART=2: launch to the first trained
# step, target vs dataset responses (~6 min); PART=3: the other CUDA tests in two steps (~10 min); PART=3b:
# the compile check's and the drafter backends' tests alone (~4 min); PART=4: a compiled sliding-window drafter
# trained and saved (~6 min).
# Each step has its own timeout and log under ${OUT:-/tmp/out}; results go to $OUT/results_partN.tgz.
set -u
OUT=${OUT:-/tmp/out}
res=/tmp/res
mkdir -p "$res" "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/extra .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/extra
python3 -c "import torch, transformers, triton, zmq, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
step() {  # step NAME SECONDS CMD...: the command's output in $OUT/NAME.log, its exit status in the summary
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: rc $? in $((SECONDS - t0)) s"
}
pytest_cuda=(python3 -m pytest -q -rs -s --tb=long --show-capture=no -p no:cacheprovider)
if [ "${PART:-1}" = 1 ]; then  # the real-eval cost runs beside the short fla test (a GPU mostly idle)
  step spec_eval_qwen3-8b 300 python3 bench/spec_eval_cost.py --shape qwen3-8b --prompts 2 \
    --max-new-tokens 128 --out "$res/h200_spec_eval_cost/qwen3-8b" &
  step hybrid_cuda_test 200 "${pytest_cuda[@]}" tests/target/test_hybrid_cuda.py
  step regen_generation 150 python3 bench/regenerate_speed.py --device cuda --shapes qwen3-1.7b,qwen3-8b \
    --prompts 64 --batch-sizes 64 --hf-prompts 2 --new-tokens 128 --launch-shapes none \
    --out "$res/h200_regenerate_speed/generation"
  wait
elif [ "$PART" = 2 ]; then
  step regen_launch 400 python3 bench/regenerate_speed.py --device cuda --shapes none \
    --launch-shapes qwen3-1.7b --launch-args "--target-gpus 0 --drafter-gpus 0 --eval-generate off" \
    --out "$res/h200_regenerate_speed/launch"
elif [ "$PART" = 3 ]; then  # alone: beside a sweep's compiles the first 87 took 330 s, the other 23 did not finish
  step cuda_tests 300 "${pytest_cuda[@]}" tests/target/test_packing.py tests/target/test_features.py \
    tests/target/test_placement.py tests/producer/test_target_thread.py tests/wire/test_cuda_ipc.py
  step cuda_tests_compile 270 "${pytest_cuda[@]}" tests/wire/test_wire_shm.py tests/train/test_compile_check.py \
    tests/drafter/test_backends.py
elif [ "$PART" = 3b ]; then  # alone: 13 tests in 196 s on the H200 (the default full compile's check 81 s)
  step compile_backends_tests 480 "${pytest_cuda[@]}" --durations=0 tests/train/test_compile_check.py \
    tests/drafter/test_backends.py
else  # PART=4: the 27B preset's drafter layout (sliding + full layers) compiled whole, trained and saved on
  # CUDA: first step at 212 s (cold compile and its check), 30 steps, exit with the last checkpoint at ~300 s
  step sliding_drafter 330 python3 -m dflash_pipe launch --plain --device cuda --drafter-preset qwen3.6-27b \
    --target-layer-ids 1,2,3,4 --responses dataset --max-steps 30 --eval-generate off --run-dir /tmp/sliding-run
fi
tar -czf "$OUT/results_part${PART:-1}.tgz" -C "$res" .
