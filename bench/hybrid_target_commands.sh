#!/usr/bin/env bash
# The H200 run behind bench/results/h200_hybrid_target: the hybrid exactness tests under the GPU machine's
# transformers (CPU, no fla), then bench/hybrid_target.py with flash-linear-attention installed from wheels
# (download them first: pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl
# flash-linear-attention fla-core). Writes under ${OUT:-/tmp/out}.
set -u
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl || exit 1
export PYTHONPATH=$PWD
timeout "${TEST_TIMEOUT:-100}" python3 -m pytest tests/target/test_hybrid.py -q -x -p no:cacheprovider -n 8 2>&1 | tail -4
export PYTHONPATH=$PWD:/tmp/fla
[ "${CUDA_TESTS:-0}" = 1 ] && timeout 180 python3 -m pytest tests/target/test_hybrid_cuda.py -q -x -p no:cacheprovider -s 2>&1 | tail -6
timeout "${BENCH_TIMEOUT:-440}" python3 bench/hybrid_target.py --out "$OUT/h200_hybrid_target" ${BENCH_ARGS:-} 2>&1 | grep -v "^{" | tail -40
