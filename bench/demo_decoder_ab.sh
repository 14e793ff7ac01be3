#!/usr/bin/env bash
# The embedded demo with each regeneration decoder, back to back, and whether both wrote the same replies
# (bench/results/cpu_demo_decoder_ab/). Usage: bash bench/demo_decoder_ab.sh OUT   (about 15 minutes on 2 cores)
set -euo pipefail
OUT=${1:?usage: bash bench/demo_decoder_ab.sh OUT}
mkdir -p "$OUT"
for decoder in auto plain; do
  rm -rf "$OUT/run_$decoder"
  start=$(date +%s)
  dflash-pipe launch --plain --run-dir "$OUT/run_$decoder" --regen-decoder "$decoder" >"$OUT/launch_$decoder.log" 2>&1
  echo "$decoder: wall $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt"
  grep -h "^regenerated:\|steps in" "$OUT/launch_$decoder.log" | tee -a "$OUT/summary.txt"
done
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
def replies(path):
    lines = (json.loads(line) for line in open(path))
    return {d["regen"]["index"]: d["messages"] for d in lines if "regen" in d}
a, b = (replies(f"{sys.argv[1]}/run_{d}/regenerated.jsonl") for d in ("auto", "plain"))
print(f"identical conversations: {sum(a[k] == b.get(k) for k in a)}/{len(a)}")
PY
