#!/usr/bin/env bash
# A second producer attaching to a running run, on CUDA: the coordinator (`launch`, demo target, one drafter
# worker) trains alone for ATTACH_AFTER seconds, then `dflash-pipe producer --connect` attaches a second
# target replica and drafter worker marked as another node (DFLASH_PIPE_NODE=node1: no ring to the
# coordinator, its features counted as crossing). Both share GPU 0 on a one-GPU machine. Records the ledger
# (every sample once?), the bytes per link, CUDA IPC use on node1 and the supply before and after.
# Usage: bash bench/h200_attached_producer.sh OUT_DIR   (SAMPLES=800 EPOCHS=2 ATTACH_AFTER=60; .whl carried)
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${1:?output dir}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
head -n "${SAMPLES:-800}" dflash_pipe/data/assets/demo.jsonl > "$out/data.jsonl"
rm -rf "$out/run"
python3 -m dflash_pipe launch --plain --target-gpus "${TARGET_GPUS:-0}" --drafter-gpus "${DRAFTER_GPUS:-0}" \
    --run-dir "$out/run" --data "$out/data.jsonl" --epochs "${EPOCHS:-2}" --responses dataset --eval-generate off \
    --eval-samples 8 > "$out/coordinator.log" 2>&1 &
coordinator=$!
address=""
for _ in $(seq 300); do
    address=$(grep -o "producer at tcp://[0-9.:]*" "$out/coordinator.log" | head -n1 | cut -d' ' -f3) || true
    [ -n "$address" ] && break
    sleep 1
done
: "${address:?the coordinator never printed its address; see $out/coordinator.log}"
sleep "${ATTACH_AFTER:-60}"
DFLASH_PIPE_NODE=node1 python3 -m dflash_pipe producer --connect "$address" --target-gpus "${TARGET_GPUS:-0}" \
    --drafter-gpus "${DRAFTER_GPUS:-0}" --name node1 > "$out/node1.log" 2>&1 &
node=$!
status=0
wait "$coordinator" || status=$?
wait "$node" || status=$?
python3 bench/attached_producer_summary.py "$out/run" | tee "$out/summary.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/summary.json.gpu"
exit "$status"
