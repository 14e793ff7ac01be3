#!/usr/bin/env bash
# Many nodes, one command per node, from a torchrun-style environment. Use it with any cluster launcher
# that starts one process per node with MASTER_ADDR and NODE_RANK set (on Slurm, slurm-multinode.sbatch):
#   MASTER_ADDR=node-a NODE_RANK=0 bash launch/multinode.sh   # node 0: the coordinator (launch), its target and drafters
#   MASTER_ADDR=node-a NODE_RANK=1 bash launch/multinode.sh   # every other node: `dflash-pipe producer --connect`
# Every node splits its own GPUs TARGET_GPUS / DRAFTER_GPUS (default 0-3 / 4-7), so features stay on the node
# and only gradients (NCCL) and control messages cross. RUN_DIR and KEYS must be on storage every node mounts:
# node 0 makes KEYS once; a RUN_DIR with a config resumes (the whole cluster: run the same command again).
# MASTER_PORT (default 5555) is the coordinator's port. Extra arguments go to `launch` / `producer`.
# NNODES (the cluster's node count) makes the run wait for every node's drafters before its first step
# (--min-workers NNODES x the drafter GPUs of a node); MIN_WORKERS sets that count directly.
set -euo pipefail
: "${MASTER_ADDR:=127.0.0.1}" "${NODE_RANK:=0}" "${MASTER_PORT:=5555}"
RUN_DIR=${RUN_DIR:-runs/multinode}
KEYS=${KEYS:-$RUN_DIR.keys}
TARGET_GPUS=${TARGET_GPUS:-0-3}
DRAFTER_GPUS=${DRAFTER_GPUS:-4-7}
dry=0
case " $* " in *" --dry-run "*) dry=1 ;; esac
split=(--target-gpus "$TARGET_GPUS" --drafter-gpus "$DRAFTER_GPUS")
count_gpus() {  # "4-7" -> 4, "0,2,5-6" -> 4
    local n=0 part parts
    IFS=, read -ra parts <<<"$1"
    for part in "${parts[@]}"; do
        if [[ $part == *-* ]]; then n=$((n + ${part#*-} - ${part%-*} + 1)); else n=$((n + 1)); fi
    done
    echo "$n"
}
if [ -z "${MIN_WORKERS:-}" ] && [ -n "${NNODES:-}" ]; then
    MIN_WORKERS=$((NNODES * $(count_gpus "$DRAFTER_GPUS")))
fi
if [ "$NODE_RANK" = 0 ]; then
    if [ "$dry" = 0 ] && [ ! -f "$KEYS/server.key_secret" ]; then
        dflash-pipe keys generate "$KEYS"
    fi
    if [ -f "$RUN_DIR/config.json" ]; then  # a requeued or resubmitted job: the run dir says how to go on
        exec dflash-pipe launch --resume "$RUN_DIR" --plain ${MIN_WORKERS:+--min-workers "$MIN_WORKERS"} "$@"
    fi
    exec dflash-pipe launch --config "${RECIPE:-launch/node-8gpu.yaml}" --run-dir "$RUN_DIR" --plain \
        --bind "tcp://0.0.0.0:$MASTER_PORT" --keys "$KEYS" "${split[@]}" \
        ${TARGET_MODEL:+--target-model "$TARGET_MODEL"} ${DATA:+--data "$DATA"} \
        ${MIN_WORKERS:+--min-workers "$MIN_WORKERS"} "$@"
fi
if [ "$dry" = 0 ]; then  # node 0 writes the keys first; the producer then waits for its WELCOME
    for _ in $(seq 300); do [ -f "$KEYS/client.key_secret" ] && break; sleep 1; done
fi
exec dflash-pipe producer --connect "tcp://$MASTER_ADDR:$MASTER_PORT" --keys "$KEYS" "${split[@]}" \
    --name "node$NODE_RANK" --join-timeout "${JOIN_TIMEOUT:-900}" "$@"
