"""The script behind h200_host_qwen3_8b_plain_sha256.json (run on the H200 machine's CPU, written to $OUT).

The Qwen3-8B drafter's trainable tensors (5 layers of H 4096, 8 KV heads x 128, ffn 12288, and fc; norms
left out, 0.1% of the bytes) in fp32, written as the checkpoint writes them (safetensors; the two AdamW
moments with torch.save), then a one-thread streaming sha256 of both files, warm and after dropping the
page cache.
"""

import hashlib
import json
import os
import time

import torch
from safetensors.torch import save_file

WORK = "/tmp/ck"
HIDDEN, FFN, LAYERS = 4096, 12288, 5


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    os.makedirs(WORK, exist_ok=True)
    shapes = {"fc": (HIDDEN, LAYERS * HIDDEN)}
    for i in range(LAYERS):
        per_layer = {
            "q": (HIDDEN, HIDDEN),
            "k": (1024, HIDDEN),
            "v": (1024, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "g": (FFN, HIDDEN),
            "u": (FFN, HIDDEN),
            "d": (HIDDEN, FFN),
        }
        shapes |= {f"{i}.{n}": s for n, s in per_layer.items()}
    weights = {k: torch.randn(s) for k, s in shapes.items()}
    r = {"params": sum(t.numel() for t in weights.values())}
    t = time.perf_counter()
    save_file(weights, f"{WORK}/w.safetensors")
    r["save_weights_s"] = time.perf_counter() - t
    state = {"state": {i: {"exp_avg": v, "exp_avg_sq": v.clone()} for i, v in enumerate(weights.values())}}
    t = time.perf_counter()
    torch.save(state, f"{WORK}/opt.pt")
    r["save_opt_s"] = time.perf_counter() - t
    del state, weights
    files = [f"{WORK}/w.safetensors", f"{WORK}/opt.pt"]
    t = time.perf_counter()
    for f in files:
        sha256(f)
    r["sha_s"] = time.perf_counter() - t
    r["gb"] = sum(os.path.getsize(f) for f in files) / 1e9
    r["gb_per_s"] = r["gb"] / r["sha_s"]
    os.system("sync; echo 1 > /proc/sys/vm/drop_caches 2>/dev/null")
    t = time.perf_counter()
    for f in files:
        sha256(f)
    r["sha_after_drop_caches_s"] = time.perf_counter() - t
    print(json.dumps(r))
    with open(os.environ["OUT"] + "/qwen3_8b_sha.json", "w") as out:
        json.dump(r, out, indent=1)


if __name__ == "__main__":
    main()
