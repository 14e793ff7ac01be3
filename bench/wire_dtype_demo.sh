#!/usr/bin/env bash
# The effect of `--wire-dtype fp8` on training: the embedded CPU demo run twice (bf16 features, then fp8),
# same seed and data; prints the final loss and tau of each and keeps both runs' metrics.
# Usage: bash bench/wire_dtype_demo.sh OUT_DIR       (about 4-8 minutes on 2 CPU cores)
set -euo pipefail
out=${1:?output dir}
mkdir -p "$out"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for dtype in bf16 fp8; do
    rm -rf "$out/run-$dtype"
    python3 -m dflash_pipe launch --plain --wire-dtype "$dtype" --run-dir "$out/run-$dtype" \
        > "$out/$dtype.log" 2>&1
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
summary = {}
for dtype in ("bf16", "fp8"):
    rows = [json.loads(line) for line in (out / f"run-{dtype}" / "metrics.jsonl").read_text().splitlines()]
    loss = [r for r in rows if "loss" in r][-1]
    tau = [r for r in rows if "tau" in r][-1]
    summary[dtype] = {"step": loss.get("step"), "loss": loss["loss"], "tau": tau["tau"]}
(out / "wire_dtype_demo.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PY
