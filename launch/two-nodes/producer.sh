#!/usr/bin/env bash
# Node A: the producer (two-nodes/producer.yaml). Start it first, then two-nodes/worker.sh on node B.
# Use two nodes when the drafters are the bottleneck (the dashboard's drafters tokens/s below the
# producer's, the queue full): node B's GPUs join the drafter group while the run goes on.
# Creates the CURVE keys on first use (copy keys/dflash to node B). Extra arguments go to `launch`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KEYS=${KEYS:-keys/dflash}
case " $* " in
    *" --dry-run "* | *" --print-config "*) ;;
    *) [ -f "$KEYS/server.key_secret" ] || dflash-pipe keys generate "$KEYS" ;;
esac
exec dflash-pipe launch --config "$here/producer.yaml" --keys "$KEYS" \
    ${TARGET_MODEL:+--target-model "$TARGET_MODEL"} ${DATA:+--data "$DATA"} ${RUN_DIR:+--run-dir "$RUN_DIR"} \
    "$@"
