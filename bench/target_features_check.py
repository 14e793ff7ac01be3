"""Which target path gives the plain forward's features on this machine: a correctness check, not a speed one.

Run (H200, ~2 min): PYTHONPATH=. python bench/target_features_check.py --out DIR

For small Qwen3/Llama shapes (head_dim 16, with and without GQA) and an 8B-shaped Qwen3 cut to 4 layers,
in fp32 (TF32 off) and bf16, it compares each path's selected-layer features with the padded SDPA forward
in fp32 (the reference): packed SDPA; packed flex with eager flex_attention; packed flex compiled (the
producer's default before compiled layers); packed flex with compiled decoder layers. Writes
DIR/target_features_check.json with the relative (Frobenius) and max-abs error of every case.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.attention.flex_attention as flex_module
from make_target import qwen3_config
from transformers import LlamaConfig

from dflash_pipe.target import TargetCore, packing
from tests.tiny_models import tiny_qwen3_config

LENGTHS = [200, 3, 77, 129, 64]
LENGTH_SWEEP = [[9, 1, 14, 6], [30], [1], [9, 21], [128], [200, 3, 77], [129], [64] * 5, [256, 1]]
"""``--sweep``: batch shapes for the small models, with and without padding rows to whole flex tiles."""


def shapes() -> dict[str, object]:
    big = qwen3_config("qwen3-8b")
    big.num_hidden_layers = 4
    big.layer_types = big.layer_types[:4]
    return {
        "qwen3 tiny gqa": tiny_qwen3_config(
            vocab_size=97, num_hidden_layers=5, head_dim=16, max_position_embeddings=1024
        ),
        "llama tiny": LlamaConfig(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=5,
            num_attention_heads=3,
            num_key_value_heads=3,
            max_position_embeddings=1024,
        ),
        "qwen3-8b 4 layers": big,
    }


def variants(config, layer_ids, dtype, state):
    def make(**kw):
        core = TargetCore(config, layer_ids, "cuda", dtype, **kw)
        core.model.load_state_dict(state)
        return core

    yield "packed sdpa", make(attention="sdpa", compile_layers=False)
    yield "packed flex compiled", make(attention="flex", compile_layers=False)
    yield "packed flex + compiled layers", make(attention="flex", compile_layers=True)
    real = packing._compiled
    packing._compiled = lambda name: getattr(flex_module, name)  # the uncompiled flex functions
    try:
        yield "packed flex eager", make(attention="flex", compile_layers=False)
    finally:
        packing._compiled = real


def sweep(rows: list[dict]) -> None:
    """Small models in fp32: each batch shape through compiled flex, padded to whole tiles or not."""
    for name, config in list(shapes().items())[:2]:
        torch.manual_seed(0)
        layer_ids = (0, 1, config.num_hidden_layers - 2)
        ref_core = TargetCore(config, layer_ids, "cuda", torch.float32, packing="padded")
        cores = {
            f"compiled flex, layers {'compiled' if c else 'eager'}": TargetCore(
                config, layer_ids, "cuda", torch.float32, attention="flex", compile_layers=c
            )
            for c in (False, True)
        }
        for core in cores.values():
            core.model.load_state_dict(ref_core.model.state_dict())
        for lengths in LENGTH_SWEEP:
            ids = torch.randint(0, config.vocab_size, (sum(lengths),))
            ref = ref_core.features(ids, lengths)
            for pad in (packing.FLEX_PAD_TO, 1):
                saved, packing.FLEX_PAD_TO = packing.FLEX_PAD_TO, pad
                try:
                    for label, core in cores.items():
                        got = core.features(ids, lengths)
                        row = {
                            "shape": name,
                            "lengths": lengths,
                            "pad_to": pad,
                            "path": label,
                            "rel_err": float((got - ref).norm() / ref.norm()),
                            "max_abs": float((got - ref).abs().max()),
                        }
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    packing.FLEX_PAD_TO = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sweep", action="store_true", help="small models over many batch shapes only")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows: list[dict] = []
    for name, config in {} if args.sweep else shapes().items():
        torch.manual_seed(0)
        layer_ids = (0, 1, config.num_hidden_layers - 2)
        ref_core = TargetCore(config, layer_ids, "cuda", torch.float32, packing="padded")
        state = ref_core.model.state_dict()
        ids = torch.randint(0, config.vocab_size, (sum(LENGTHS),))
        ref = ref_core.features(ids, LENGTHS).float()
        for dtype in (torch.float32, torch.bfloat16):
            for label, core in variants(config, layer_ids, dtype, state):
                for _ in range(2):  # the second call runs the compiled code as the producer does later
                    got = core.features(ids, LENGTHS).float()
                err = (got - ref).norm() / ref.norm()
                row = {
                    "shape": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "path": label,
                    "rel_err": float(err),
                    "max_abs": float((got - ref).abs().max()),
                    "ref_max_abs": float(ref.abs().max()),
                    "layers_compiled": core.layers_compiled,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                del core
                torch.cuda.empty_cache()
    if args.sweep:
        sweep(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("target_features_sweep.json" if args.sweep else "target_features_check.json")).write_text(
        json.dumps(rows, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
