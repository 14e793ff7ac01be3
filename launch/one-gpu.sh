#!/usr/bin/env bash
# Target and drafter on GPU 0 (one-gpu.yaml). Use it on a one-GPU machine or for a small target.
# Override with TARGET_MODEL, DATA, RUN_DIR; extra arguments go to `dflash-pipe launch` (e.g. --dry-run).
#   TARGET_MODEL=/models/Qwen3-1.7B DATA=chat.jsonl bash launch/one-gpu.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec dflash-pipe launch --config "$here/one-gpu.yaml" \
    ${TARGET_MODEL:+--target-model "$TARGET_MODEL"} ${DATA:+--data "$DATA"} ${RUN_DIR:+--run-dir "$RUN_DIR"} \
    "$@"
