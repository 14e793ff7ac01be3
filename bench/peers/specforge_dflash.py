"""SpecForge's DFlash trainer on the same token rows as dflash-pipe, within one wall-clock budget.

Capture (an HF forward of the target writing SpecForge's offline `.ckpt` records) and training (SpecForge's
own `specforge train` program path, in-process) share `--minutes`, counted from the start of the capture;
checkpoints are saved at a quarter and a half of the budget (or `--save-at`) and at the end, each exported
with SpecForge's `export_to_hf` to a folder `dflash-pipe eval --drafter` loads. The logic is in
`dflash_pipe/bench/peers.py`. The horizon of SpecForge's cosine schedule is fitted to the budget from the
step rate (or set with `--steps`); a mark that passes during the capture saves the first training step.

    # rows exactly as dflash-pipe trains on them (its tokenizer path), then the peer run:
    python bench/peers/specforge_dflash.py --target /tmp/smol --conversations /tmp/exp/sg.jsonl \
        --max-rows 3000 --max-length 3072 --rows rows.jsonl --out out/specforge --minutes 8 --mask-token-id 16
    # the same rows for dflash-pipe: dflash-pipe launch --data rows.jsonl ...
    dflash-pipe eval --target-model /tmp/smol --drafter out/specforge/export/final --data heldout.jsonl

SpecForge 0.2.0 pins torch==2.11.0, transformers==5.8.1 and sglang, none of which its offline trainer
needs: install it with `pip install --no-deps`. Wheels to carry to a machine without internet (Python
3.12; torch, transformers, safetensors, pyyaml, huggingface_hub, numpy as dflash-pipe has them):

    specforge==0.2.0            (pure Python; pip install --no-deps)
    pydantic==2.14.4            (its typed config)
    pydantic_core==2.50.5       (the cp312 manylinux x86_64 wheel)
    annotated_types==0.8.0
    typing_inspection==0.4.5
    accelerate==1.16.0          (set_seed in its training entry; skip if installed; needs psutil)

Not needed and not imported on this path: sglang, wandb, tensorboard (`tracking.report_to: none`),
datasets, openai-harmony, yunchang (sequence parallelism only), flash-attn, liger-kernel.

Tested end to end on CPU only (2 contended cores, torch 2.13, transformers 5.25, 40 rows of <= 256 tokens,
--minutes 3 --max-anchors 64): 39 rows captured in 90 s, 35 SpecForge steps in 92 s, loss 41.8 -> 9.2,
per-slot accuracy 0.04-0.08, the export evaluated by `dflash-pipe eval` (lossless, tau 1.02). On CUDA
SpecForge's defaults apply (bf16, flex attention, FSDP SHARD_GRAD_OP on one rank): not yet run here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dflash_pipe.bench import peer_common as common
from dflash_pipe.bench import peers
from dflash_pipe.bench.save import provenance


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.peer_arg_parser(__doc__.split("\n")[0])
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--loader-workers", type=int, help="SpecForge's dataloader workers (default its own, 8)")
    return common.check_peer_args(p, p.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = common.prepare_rows(args)
    if args.rows_only:
        return 0
    specforge = peers.import_specforge()
    rows = common.read_rows(args.rows, tokenizer, max_length=args.max_length)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")

    features = args.out / "features"
    cap = common.capture_timed(
        args,
        rows,
        lambda config: peers.target_layer_ids(config.num_hidden_layers, args.layers),
        lambda target, ids, stop: peers.capture_features(target.model, rows, ids, features, should_stop=stop),
    )
    start, deadline, layer_ids, captured, capture_s = (
        cap.start, cap.deadline, cap.layer_ids, cap.captured, cap.capture_s
    )  # fmt: skip

    recipe = peers.PeerRecipe(
        target=args.target,
        features=features,
        out_dir=args.out / "train",
        num_draft_layers=args.layers,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        max_length=args.max_length,
        lr=args.lr,
        num_anchors=args.max_anchors,
        gamma=args.gamma,
        batch_size=args.batch_size,
        steps=args.steps,
        device=args.device,
        seed=args.seed,
        loader_workers=args.loader_workers,
    )
    metrics_path = args.out / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    budget = common.TimeBudget(
        start=start,
        deadline=deadline,
        marks=common.budget_marks(args.minutes, args.save_at),
        metrics_path=metrics_path,
        warmup_ratio=recipe.warmup_ratio,
        fit_horizon=args.steps is None,
    )
    train_start = time.perf_counter()
    try:
        trainer = peers.train_specforge(recipe, budget, args.out / "specforge_config.json")
        train_s = time.perf_counter() - train_start
        final = {"step": trainer.global_step, "elapsed_s": round(time.perf_counter() - start, 3)}
        final["uri"] = f"file://{(recipe.out_dir / f'{peers.RUN_ID}-step{trainer.global_step}').resolve()}"
        checkpoints = [c for c in budget.saved if c["step"] != final["step"]] + [final]
        draft_config = peers.write_draft_config(trainer, args.out / "draft_config.json")
        files = sorted(features.glob("*.ckpt"))[-args.slot_rows :]
        slots = peers.slot_accuracy(peers.training_model(trainer), files, device)
    finally:
        peers.close_distributed()

    for c in checkpoints:
        name = "final" if c is final else f"step{c['step']}"
        c["export"] = str(
            peers.export_reference(c["uri"], draft_config, args.target, args.out / "export" / name)
        )
    summary = {
        "name": "specforge_dflash",
        "provenance": provenance()
        | {"specforge": getattr(specforge, "__version__", None) or common.package_version("specforge")},
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "specforge_config": json.loads((args.out / "specforge_config.json").read_text()),
        "target_layer_ids": layer_ids,
        "rows": len(rows),
        "rows_captured": captured,
        "capture_s": round(capture_s, 3),
        "train_s": round(train_s, 3),
        "total_s": round(time.perf_counter() - start, 3),
        "steps": trainer.global_step,
        "stopped_by": budget.stopped_by,
        "horizon_steps": args.steps or budget.horizon,
        "samples_seen": trainer.global_step * args.batch_size,
        "tokens_seen_estimate": round(
            trainer.global_step * args.batch_size * common.mean_row_tokens(rows[:captured])
        ),
        "epochs": round(trainer.global_step * args.batch_size / max(1, captured), 3),
        "last_metrics": budget.last,
        **common.metrics_tail(metrics_path),
        "slot_accuracy": slots,
        "checkpoints": checkpoints,
        "specforge_pieces": [
            "specforge.config.load_config / Config (typed run config)",
            "specforge.application.resolve_run, bind_run, build_application_run",
            "specforge.distributed.init_distributed / destroy_distributed",
            "offline reader, dflash_family_offline_v1 normalizer, collator, FeatureDataLoader",
            "DFlashDraftModel (draft derived from the target), OnlineDFlashModel (anchors, masks, loss)",
            "BF16Optimizer + CosineAnnealingWarmupLR, FSDP (cuda) / DDP NO_SHARD (cpu) backend",
            "Trainer / TrainerController / CheckpointManager",
            "specforge.export.to_hf.export_to_hf",
        ],
    }
    (args.out / "specforge_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("capture_s", "train_s", "steps", "slot_accuracy")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
