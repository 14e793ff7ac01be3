#!/usr/bin/env bash
# `dflash-pipe bench split` on one H200: the probe of one target replica and one drafter (random-initialised
# Qwen3-1.7B-shaped target, demo conversations), and with --verify the pipeline on the shared device beside
# the probe's prediction. On one GPU the pick is "shared": the share of the device each side needs.
# Needs .whl (pyzmq for python 3.12). About 5 minutes.
# Usage: bash bench/h200_split.sh OUT_DIR [SECONDS] [GPUS (default 0)] [RESPONSES (dataset|target)]
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${1:?output dir}; seconds=${2:-8}; gpus=${3:-0}; responses=${4:-dataset}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
python3 bench/make_target.py --shape qwen3-1.7b --demo-vocab --out "$work/target"
python3 -m dflash_pipe bench split --target-model "$work/target" --gpus "$gpus" --data dflash_pipe/data/assets/demo.jsonl \
    --token-budget 4096 --max-length 1024 --responses "$responses" --max-new-tokens 128 --seconds "$seconds" --verify \
    --out "$out" 2>&1 | tee "$out/run.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/run.log"
