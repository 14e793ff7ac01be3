#!/usr/bin/env bash
# `dflash-pipe bench throughput --responses target` on one H200: the pipeline on the demo conversations'
# dataset responses, and again with a random-initialised Qwen3-1.7B-shaped target regenerating every
# assistant turn as the drafters train (target and drafter workers share GPU 0). The target's vocabulary is
# the demo tokenizer's, so its replies decode to text; random weights never end a turn, so every reply is
# --max-new-tokens long. Needs .whl (pyzmq for python 3.12). About 6 minutes.
# Usage: bash bench/h200_throughput_target_responses.sh OUT_DIR [SECONDS] [MAX_NEW_TOKENS] [REGEN_BATCH (0: auto)]
# On two GPUs (the real layout: target and drafters apart): TARGET_GPUS=0 DRAFTER_GPUS=1 bash ...
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${1:?output dir}; seconds=${2:-8}; new_tokens=${3:-128}; regen_batch=${4:-0}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
python3 - "$work/target" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM

from bench.make_target import qwen3_config
from dflash_pipe.data import demo_tokenizer

config = qwen3_config("qwen3-1.7b")
config.vocab_size = len(demo_tokenizer())  # the replies must decode to the tokenizer's text
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
demo_tokenizer().save_pretrained(sys.argv[1])
print(f"random qwen3-1.7b shape, vocab {config.vocab_size}, in {sys.argv[1]}")
EOF
python3 -m dflash_pipe bench throughput --target-model "$work/target" --target-gpus "${TARGET_GPUS:-0}" --drafter-gpus "${DRAFTER_GPUS:-0}" \
    --data dflash_pipe/data/assets/demo.jsonl --token-budget 4096 --max-length 1024 --responses target --max-new-tokens "$new_tokens" \
    --regen-batch "$regen_batch" \
    --seconds "$seconds" --out "$out" 2>&1 | tee "$out/run.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/run.log"
