"""What a checkpoint's manifest costs: the sha256 of every file, read back once written, and the resume's check.

A module with the drafter's trainable tensors (the shapes of a DFlash drafter of the given width and depth,
fc included; the frozen embedding and LM head are never saved) and an AdamW state after one step is saved
with ``save_checkpoint``; the run times the whole save, the manifest part of it, and ``verify_checkpoint``.
  PYTHONPATH=. python bench/checkpoint_manifest_cost.py --shape demo --out DIR      # the CPU demo's drafter
  PYTHONPATH=. python bench/checkpoint_manifest_cost.py --shape qwen3-8b --out DIR  # 1.05B params, ~12.6 GB
Writes DIR/checkpoint_manifest_cost_<shape>.json. Times are from the page cache (the files were just
written); a resume after a reboot reads from disk as well.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from dflash_pipe.train import checkpoint as ck

SHAPES = {  # hidden, intermediate, heads, kv heads, head_dim, draft layers
    "demo": (128, 384, 4, 2, 32, 3),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 5),
}


class DrafterTensors(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, kv: int, head_dim: int, layers: int) -> None:
        super().__init__()
        shapes = {
            "fc.weight": (hidden, layers * hidden),
            "hidden_norm.weight": (hidden,),
            "norm.weight": (hidden,),
        }
        for i in range(layers):
            p = f"layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        self.params = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.randn(s) * 0.02) for k, s in shapes.items()}
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="demo")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="Where the checkpoint is written (default: a temp dir).")
    parser.add_argument(
        "--big-mib",
        type=int,
        default=0,
        help="Also hash a file of this many MiB on 1 thread and on the default.",
    )
    args = parser.parse_args(argv)
    model = DrafterTensors(*SHAPES[args.shape])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    timed = {"manifest_s": 0.0}
    write = ck.write_manifest

    def timed_manifest(path: Path) -> None:
        t = time.perf_counter()
        write(path)
        timed["manifest_s"] += time.perf_counter() - t

    ck.write_manifest = timed_manifest
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        t = time.perf_counter()
        path = ck.save_checkpoint(
            Path(work), step=1, model=model, drafter_config={}, optimizer=opt, ledger={}
        )
        save_s = time.perf_counter() - t
        t = time.perf_counter()
        assert ck.verify_checkpoint(path) is None
        verify_s = time.perf_counter() - t
        sizes = {f.name: f.stat().st_size for f in path.iterdir()}
    total = sum(sizes.values())
    result = {
        "shape": args.shape,
        "trainable_params": params,
        "bytes": sizes,
        "total_gb": total / 1e9,
        "save_s": save_s,
        "manifest_s": timed["manifest_s"],
        "manifest_share_of_save": timed["manifest_s"] / save_s,
        "verify_s": verify_s,
        "sha256_gb_per_s": total / 1e9 / verify_s,
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "torch": torch.__version__,
    }
    if args.big_mib:
        result["big_file"] = _threads(args.big_mib, args.work)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"checkpoint_manifest_cost_{args.shape}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "bytes"}, indent=2))
    return result


def _threads(mib: int, work: Path | None) -> dict[str, float]:
    """GB/s of ``file_digests`` on one thread and on the default (``min(8, cores)``), from the page cache."""
    import os

    with tempfile.NamedTemporaryFile(dir=work) as f:
        block = os.urandom(1 << 20)
        for _ in range(mib):
            f.write(block)
        f.flush()
        ck.file_digests(f.name)  # into the page cache
        out = {"gb": mib * (1 << 20) / 1e9, "default_threads": ck._HASH_THREADS}
        for label, threads in (("1_thread", 1), ("default", ck._HASH_THREADS)):
            saved, ck._HASH_THREADS = ck._HASH_THREADS, threads
            t = time.perf_counter()
            ck.file_digests(f.name)
            out[f"{label}_gb_per_s"] = out["gb"] / (time.perf_counter() - t)
            ck._HASH_THREADS = saved
    return out


if __name__ == "__main__":
    main()
