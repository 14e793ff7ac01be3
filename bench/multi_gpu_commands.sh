#!/usr/bin/env bash
# Issue 8 on a multi-GPU machine: bench/multi_gpu.py's four runs on a random-initialised Qwen3-8B-shaped
# target, in parts that each stay under ~9 minutes (the device tool allows 10 minutes a call):
#   bash bench/multi_gpu_commands.sh OUT part1   # build target + data (once), scaling-producer, scaling-drafters
#   bash bench/multi_gpu_commands.sh OUT part2   # elastic: attach a worker mid-run, SIGKILL it, the ledger
#   bash bench/multi_gpu_commands.sh OUT part3   # topology: bench throughput --compare on the design topology
#   bash bench/multi_gpu_commands.sh OUT all     # the three in one go (only without a per-call limit)
# Writes OUT/<name>.{json,png} and OUT/run.log. The target and data are built once into $DFLASH_I8_SCRATCH
# (default /tmp/dflash-i8) and reused by later parts while the machine stays up; run dirs go there too, so
# nothing large lands in OUT. GPUs: the design topology for the visible count (x2 -> target 0 / drafters 1,
# x4 -> 0-1 / 2-3, x8 -> 0-4 / 5-7). On x2 the design has one GPU per side, so the scaling parts use both
# GPUs: the producer scales over 0-1, and the drafters over 0-1 with the target on 0 (shared, noted in JSON).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${1:?output dir}; part=${2:?part1, part2, part3 or all}
seconds=${SECONDS_PER_STAGE:-5}
mkdir -p "$out"
out=$(cd "$out" && pwd)
scratch=${DFLASH_I8_SCRATCH:-/tmp/dflash-i8}
mkdir -p "$scratch"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log() { tee -a "$out/run.log"; }
gpus=$(nvidia-smi -L | wc -l)
start=$(date +%s)
echo "bench/multi_gpu_commands.sh $part on $gpus GPUs, $seconds s per stage" | log
if [ ! -f "$scratch/target/config.json" ]; then
    python3 bench/make_target.py --shape qwen3-8b --out "$scratch/target" 2>&1 | log
fi
if [ ! -f "$scratch/data.jsonl" ]; then
    python3 bench/make_data.py --out "$scratch/data.jsonl" --samples 1000 --min-len 128 --max-len 2048 2>&1 | log
fi
common=(--out "$out" --target-model "$scratch/target" --data "$scratch/data.jsonl" --seconds "$seconds"
    --token-budget 4096 --max-length 2048)
producer=(); drafters=()
if [ "$gpus" = 2 ]; then producer=(--target-gpus 0-1); drafters=(--target-gpus 0 --drafter-gpus 0-1); fi
run() { python3 bench/multi_gpu.py "$1" --work "$scratch/work-$1" "${@:2}" "${common[@]}" 2>&1 | log
    rm -rf "$scratch/work-$1"; }
case $part in
    part1|all) run scaling-producer "${producer[@]}"; run scaling-drafters "${drafters[@]}" ;;&
    part2|all) run elastic --samples 1000 --timeout 300 ;;&
    part3|all) run topology ;;
    part1|part2) ;;
    *) echo "unknown part $part: use part1, part2, part3 or all" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | log
echo "bench/multi_gpu_commands.sh $part: $(( $(date +%s) - start )) s; results in $out" | log
