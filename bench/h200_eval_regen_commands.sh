#!/usr/bin/env bash
# The H200 runs behind bench/results/h200_{hybrid_cuda_tests,spec_eval_cost,regenerate_speed}: the CUDA-only
# hybrid tests (flash-linear-attention kernels in fp32 against HF per sample), the real-eval cost per
# prompt, and the regeneration speed. Needs the wheels in .whl (pyzmq, flash-linear-attention, fla-core for
# python 3.12: pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl ...).
# PART=1: tests + real-eval cost (~6 min); PART=2: regeneration speed (~7 min). Writes under ${OUT:-/tmp/out}.
set -u
OUT=${OUT:-/tmp/out}
res=/tmp/res
mkdir -p "$res" "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/extra .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/extra
python3 -c "import torch, transformers, triton, zmq; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
if [ "${PART:-1}" = 1 ]; then
  timeout 150 python3 -m pytest tests/target/test_hybrid_cuda.py -q -x -p no:cacheprovider 2>&1 | tail -8
  for shape in qwen3-1.7b qwen3-8b; do
    timeout 170 python3 bench/spec_eval_cost.py --shape $shape --prompts 3 --out "$res/h200_spec_eval_cost/$shape" 2>&1 | tail -25
  done
else
  timeout 480 python3 bench/regenerate_speed.py --device cuda --prompts 32 --hf-prompts 4 \
      --out "$res/h200_regenerate_speed" 2>&1 | tail -40
fi
tar -czf "$OUT/results_part${PART:-1}.tgz" -C "$res" .
