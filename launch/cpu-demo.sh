#!/usr/bin/env bash
# The CPU demo (cpu-demo.yaml): no GPU, no model download. Use it first, on any machine.
# Extra arguments go to `dflash-pipe launch`, e.g. --max-steps 20 for a 1-minute run, --dry-run for the plan.
#   bash launch/cpu-demo.sh && dflash-pipe report runs/cpu-demo
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec dflash-pipe launch --config "$here/cpu-demo.yaml" ${RUN_DIR:+--run-dir "$RUN_DIR"} "$@"
