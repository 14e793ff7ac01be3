#!/usr/bin/env bash
# One 8-GPU node, Qwen3-8B-class target on GPUs 0-4, drafter workers on GPUs 5-7 (node-8gpu.yaml).
# Use it for a full training run on one node. Override paths with TARGET_MODEL, DATA, RUN_DIR; any extra
# arguments go to `dflash-pipe launch` (e.g. --dry-run to see the plan, --max-steps 100 for a smoke test).
#   TARGET_MODEL=/models/Qwen3-8B DATA=chat.jsonl bash launch/node-8gpu.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec dflash-pipe launch --config "$here/node-8gpu.yaml" \
    ${TARGET_MODEL:+--target-model "$TARGET_MODEL"} ${DATA:+--data "$DATA"} ${RUN_DIR:+--run-dir "$RUN_DIR"} \
    "$@"
