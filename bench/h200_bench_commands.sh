#!/usr/bin/env bash
# The three `dflash-pipe bench` commands with the H200 settings of docs/performance.md, on one GPU:
# a random-initialised Qwen3-1.7B-shaped target and the drafter workers share GPU 0.
# Usage: bash bench/h200_bench_commands.sh OUT_DIR [SHAPE] [SECONDS]   (SHAPE from bench/make_target.py)
# Writes OUT_DIR/{throughput,transport,compile}.{json,png} and OUT_DIR/run.log. On an H200 with SECONDS=6: throughput
# 4.7 min, compile (once,each) 3.6 min, transport ~1 min; the device tool allows 10 minutes a call, so split it there.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${1:?output dir}; shape=${2:-qwen3-1.7b}; seconds=${3:-8}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log() { tee -a "$out/run.log"; }
start=$(date +%s)
python3 bench/make_target.py --shape "$shape" --out "$work/target" 2>&1 | log
python3 bench/make_data.py --out "$work/data.jsonl" --samples 600 --min-len 128 --max-len 3072 2>&1 | log
# 1. Each stage alone and the pipeline (plus offline and threaded drafters), on the same data.
python3 -m dflash_pipe bench throughput --target-model "$work/target" --data "$work/data.jsonl" \
    --target-gpus 0 --drafter-gpus 0 --token-budget 4096 --max-length 3072 \
    --seconds "$seconds" --compare --out "$out" 2>&1 | log
# 2. Every transport against memcpy, landing on the GPU.
python3 -m dflash_pipe bench transport --device cuda --sizes-mib 1,16,126 --out "$out" 2>&1 | log
# 3. Time to first step: cold, warm, and 2 workers started together on one cache (both on GPU 0).
python3 -m dflash_pipe bench compile --target-model "$work/target" --drafter-gpus 0 --workers 2 --compile-warmup once,each \
    --out "$out" 2>&1 | log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | log
echo "bench/h200_bench_commands.sh: $(( $(date +%s) - start )) s in all; results in $out" | log
