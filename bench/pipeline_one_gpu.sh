#!/usr/bin/env bash
# `dflash-pipe launch` with the target and one drafter worker on the same GPU: tokens/s per stage and each
# worker's time to first step, on a cold and then a warm compile cache.
# Usage: bash bench/pipeline_one_gpu.sh OUT_DIR [SHAPE] [STEPS]     (SHAPE from bench/make_target.py)
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${1:?output dir}; shape=${2:-qwen3-1.7b}; steps=${3:-60}
mkdir -p "$out"
work=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-}:$(pwd) PYTHONUNBUFFERED=1
python3 bench/make_target.py --shape "$shape" --out "$work/target" 2>&1 | tee -a "$out/run.log"
python3 bench/make_data.py --out "$work/data.jsonl" --samples 1500 --min-len 128 --max-len 3072 2>&1 | tee -a "$out/run.log"
common=(--target-model "$work/target" --data "$work/data.jsonl" --target-gpus 0 --drafter-gpus 0
        --token-budget 4096 --max-length 3072 --plain --checkpoint-every 100000 --eval-samples 8)
# Cold: a new run dir, so a new compile cache.
python3 -m dflash_pipe launch "${common[@]}" --run-dir "$work/run" --max-steps "$steps" 2>&1 | tee -a "$out/run.log"
# Warm: resume the same run (same cache) for more steps.
python3 -m dflash_pipe launch --resume "$work/run" --max-steps $((steps * 2)) --plain 2>&1 | tee -a "$out/run.log"
cp "$work/run/metrics.jsonl" "$out/metrics.jsonl"
cp "$work/run/config.json" "$out/config.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$out/run.log"
