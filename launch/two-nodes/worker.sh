#!/usr/bin/env bash
# Node B: attach drafter workers to the producer on node A (two-nodes/worker.yaml). Use it to add
# drafter GPUs from another machine to a run that two-nodes/producer.sh started.
#   PRODUCER_HOST=node-a bash launch/two-nodes/worker.sh
# Ctrl-C (or SIGTERM) drains these workers: they finish their step, return their leases and leave.
# Extra arguments go to `dflash-pipe worker` (e.g. --gpus 0-3 to attach only four).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${PRODUCER_HOST:?set PRODUCER_HOST to the address of node A}"
exec dflash-pipe worker --config "$here/worker.yaml" --connect "tcp://$PRODUCER_HOST:${PRODUCER_PORT:-5555}" "$@"
