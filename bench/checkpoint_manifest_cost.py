"""What a checkpoint's manifest costs: the sha256 of every file, read back once written, and the resume's check.

The real DFlash drafter of the given shape (its frozen embedding and LM head, never saved, get a tiny
vocabulary) and an AdamW state after one step are saved with ``save_checkpoint``; the run times the whole save, the manifest part of it, and ``verify_checkpoint``.
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

from dflash_pipe.config.drafter import default_target_layer_ids
from dflash_pipe.drafter import DFlashDrafter, DrafterConfig
from dflash_pipe.run import checkpoint as ck
from dflash_pipe.run import manifest

SHAPES = {  # DrafterConfig fields: the demo drafter, and the Qwen3-8B recipe's (docs/drafter.md)
    "demo": dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, num_hidden_layers=3, num_target_layers=6),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, num_hidden_layers=5, num_target_layers=36),
}  # fmt: skip


def build_drafter(shape: dict[str, int]) -> DFlashDrafter:
    """The real drafter of that shape; its embedding and LM head (frozen, never saved) get a tiny vocabulary."""
    vocab, layers = 8, shape["num_hidden_layers"]
    ids = default_target_layer_ids(shape["num_target_layers"], layers)
    cfg = DrafterConfig(**shape, vocab_size=vocab, mask_token_id=vocab - 1, target_layer_ids=ids)
    embed = torch.nn.Embedding(vocab, cfg.hidden_size)
    head = torch.nn.Linear(cfg.hidden_size, vocab, bias=False)
    return DFlashDrafter(cfg, embed.requires_grad_(False), head.requires_grad_(False))  # saved, never run


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
    model = build_drafter(SHAPES[args.shape])
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    params = sum(p.numel() for p in trainable)
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
        manifest.file_digests(f.name)  # into the page cache
        out = {"gb": mib * (1 << 20) / 1e9, "default_threads": manifest._HASH_THREADS}
        for label, threads in (("1_thread", 1), ("default", manifest._HASH_THREADS)):
            saved, manifest._HASH_THREADS = manifest._HASH_THREADS, threads
            t = time.perf_counter()
            manifest.file_digests(f.name)
            out[f"{label}_gb_per_s"] = out["gb"] / (time.perf_counter() - t)
            manifest._HASH_THREADS = saved
    return out


if __name__ == "__main__":
    main()
