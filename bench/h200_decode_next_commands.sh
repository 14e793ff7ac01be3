#!/usr/bin/env bash
# What issue 30's decoding work still needs from an H200, in one device call (~10 min; the hybrid CUDA
# tests alone compile for ~130 s): the CUDA decode tests (the static-size decode step on the Triton kernel,
# compiled packed prefill, the hybrid stack in its 2e-2 form), then bench/decode_speed.py at the 1.7B shape
# with padded and with packed prefill (which one becomes the default), then the whole issue bench with the
# faster one. Needs .whl (pyzmq, flash-linear-attention, fla-core for python 3.12). Logs and JSON under
# ${OUT:-/tmp/out}.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/extra .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/extra
step() {  # step NAME SECONDS CMD...: output in $OUT/NAME.log, exit status in the summary
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: rc $? in $((SECONDS - t0)) s"
}
pytest_cuda=(python3 -m pytest -q -rs --tb=short -p no:cacheprovider)
step decode_cuda_tests 420 "${pytest_cuda[@]}" tests/target/test_decode_attention_kernel.py \
  tests/target/test_decode_compiled.py tests/target/test_decode_verify.py tests/target/test_decode_hybrid_cuda.py
one=(python3 bench/decode_speed.py --shapes qwen3-1.7b --batch-sizes 64 --prompts 256 --hf-batch 0
  --exact-prompts 0 --turns-conversations 0)
step padded 100 "${one[@]}" --prefill-layout padded --out "$OUT/padded"
step packed 100 "${one[@]}" --prefill-layout packed --out "$OUT/packed"
grep -ho '"qwen3-1.7b_batch64_tokens_per_s": [0-9.]*' "$OUT"/padded/decode_speed.json "$OUT"/packed/decode_speed.json
if [ "${FULL:-1}" = 1 ]; then
  step decode_speed 300 python3 bench/decode_speed.py --device cuda --prompts 256 --exact-prompts 2 \
    --turns-conversations 32 --prefill-layout "${LAYOUT:-packed}" --out "$OUT/full"
fi
rm -f "$OUT"/*/*.png
