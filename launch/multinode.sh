#!/usr/bin/env bash
# Many nodes, one command per node, from a torchrun-style environment. Use it with any cluster launcher
# that starts one process per node with MASTER_ADDR and NODE_RANK set (on Slurm, slurm-multinode.sbatch):
#   MASTER_ADDR=node-a NODE_RANK=0 bash launch/multinode.sh   # node 0: the coordinator (launch), its target and drafters
#   MASTER_ADDR=node-a NODE_RANK=1 bash launch/multinode.sh   # every other node: `dflash-pipe producer --connect`
# Every node splits its own GPUs TARGET_GPUS / DRAFTER_GPUS (default 0-3 / 4-7), so features stay on the node
# and only gradients (NCCL) and control messages cross. RUN_DIR and KEYS must be on storage every node mounts:
# node 0 makes KEYS once; a RUN_DIR with a config resumes (the whole cluster: run the same command again).
# MASTER_PORT (default 5555) is the coordinator's port. Extra arguments go to `launch` / `producer`.
set -euo pipefail
: "${MASTER_ADDR:=127.0.0.1}" "${NODE_RANK:=0}" "${MASTER_PORT:=5555}"
RUN_DIR=${RUN_DIR:-runs/multinode}
KEYS=${KEYS:-$RUN_DIR.keys}
TARGET_GPUS=${TARGET_GPUS:-0-3}
DRAFTER_GPUS=${DRAFTER_GPUS:-4-7}
dry=0
case " $* " in *" --dry-run "*) dry=1 ;; esac
split=(--target-gpus "$TARGET_GPUS" --drafter-gpus "$DRAFTER_GPUS")
if [ "$NODE_RANK" = 0 ]; then
    if [ "$dry" = 0 ] && [ ! -f "$KEYS/server.key_secret" ]; then
        dflash-pipe keys generate "$KEYS"
    fi
    if [ -f "$RUN_DIR/config.json" ]; then  # a requeued or resubmitted job: the run dir says how to go on
        exec dflash-pipe launch --resume "$RUN_DIR" --plain "$@"
    fi
    exec dflash-pipe launch --config "${RECIPE:-launch/node-8gpu.yaml}" --run-dir "$RUN_DIR" --plain \
        --bind "tcp://0.0.0.0:$MASTER_PORT" --keys "$KEYS" "${split[@]}" \
        ${TARGET_MODEL:+--target-model "$TARGET_MODEL"} ${DATA:+--data "$DATA"} "$@"
fi
if [ "$dry" = 0 ]; then  # node 0 writes the keys first; the producer then waits for its WELCOME
    for _ in $(seq 300); do [ -f "$KEYS/client.key_secret" ] && break; sleep 1; done
fi
exec dflash-pipe producer --connect "tcp://$MASTER_ADDR:$MASTER_PORT" --keys "$KEYS" "${split[@]}" \
    --name "node$NODE_RANK" --join-timeout "${JOIN_TIMEOUT:-900}" "$@"
