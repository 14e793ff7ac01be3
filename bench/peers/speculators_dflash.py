"""speculators' DFlash trainer on the same token rows as dflash-pipe, within one wall-clock budget.

Capture (an HF forward of the target writing speculators' offline dataset: its pre-tokenized rows and one
``hs_{i}.safetensors`` per row) and training (speculators' own ``speculators train`` program path,
in-process, every draft layer full attention) share `--minutes`, counted from the start of the capture;
checkpoints are saved at a quarter and a half of the budget (or `--save-at`) and at the end, each exported
to a folder `dflash-pipe eval --drafter` loads. The logic is in `dflash_pipe/bench/speculators_peer.py`
(what it shares with the SpecForge peer in `peer_common.py`). Without `--steps` the horizon of its LR
schedule is fitted to the budget from the step rate.

    # rows exactly as dflash-pipe trains on them, then the peer run:
    python bench/peers/speculators_dflash.py --target /tmp/smol --conversations RUN/regenerated.jsonl \
        --max-length 2048 --rows rows.jsonl --out out/speculators --minutes 8 --mask-token-id 16
    dflash-pipe eval --target-model /tmp/smol --drafter out/speculators/export/final --data heldout.jsonl

Its recipe is its own DFlash defaults (CE on the target's argmax, D-PACE slot weights, Muon at lr 1e-3, a
linear schedule with 1% warm-up, 512 anchors per packed row of 8192 tokens) unless a flag says otherwise.
speculators 0.9.0 pins transformers <= 5.19, datasets <= 5.1, torchvision and torchaudio, none of which this
path needs: install it with `pip install --no-deps`, with the packages `tests/real/speculators_site.py`
lists (bench/real_model_carries.sh downloads them for the device). `datasets` must be installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from dflash_pipe.bench import peer_common as common
from dflash_pipe.bench import speculators_peer as sp
from dflash_pipe.bench import speculators_weights as weights
from dflash_pipe.bench.save import provenance


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.peer_arg_parser(__doc__.split("\n")[0])
    p.add_argument("--lr", type=float, default=1e-3, help="its --lr (and Muon's)")
    p.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    p.add_argument("--scheduler", default="linear", choices=["linear", "cosine"])
    p.add_argument("--warmup-ratio", type=float, default=0.01)
    p.add_argument("--loss-fn", default="ce", help="its --loss-fn (ce, kl_div, ... or a JSON mix)")
    p.add_argument(
        "--loss-weight", default="dpace", choices=["dpace", "fixed-exp-decay"], help="its slot weights"
    )
    p.add_argument("--gamma", type=float, default=7.0, help="exp(-(k-1)/gamma) with fixed-exp-decay")
    p.add_argument("--total-seq-len", type=int, default=8192, help="tokens packed into one step's row")
    p.add_argument("--loader-workers", type=int, default=2)
    return common.check_peer_args(p, p.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dflash_pipe.drafter import DrafterConfig

    tokenizer = common.prepare_rows(args)
    if args.rows_only:
        return 0
    speculators = sp.import_speculators()
    rows = common.read_rows(args.rows, tokenizer, max_length=args.max_length)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    data_dir, save_dir = args.out / "data", args.out / "train"
    for old in (data_dir, save_dir):
        shutil.rmtree(old, ignore_errors=True)
    sp.write_dataset(rows, tokenizer, data_dir, max_length=args.max_length)

    def drafter_config(target_config: object) -> DrafterConfig:
        return DrafterConfig.from_target(
            target_config,
            num_layers=args.layers,
            block_size=args.block_size,
            mask_token_id=args.mask_token_id,
            max_anchors=args.max_anchors,
        )

    cap = common.capture_timed(
        args,
        rows,
        lambda config: list(drafter_config(config).target_layer_ids),
        lambda target, ids, stop: sp.capture_hidden_states(target, rows, ids, data_dir, should_stop=stop),
    )
    start, layer_ids, captured, capture_s = cap.start, cap.layer_ids, cap.captured, cap.capture_s
    cfg = drafter_config(cap.target_config)
    sp.keep_rows(data_dir, captured)

    recipe = sp.SpeculatorsRecipe(
        target=args.target,
        data_dir=data_dir,
        save_dir=save_dir,
        target_layer_ids=layer_ids,
        mask_token_id=args.mask_token_id,
        rows=captured,
        num_draft_layers=args.layers,
        block_size=args.block_size,
        total_seq_len=args.total_seq_len,
        max_anchors=args.max_anchors,
        lr=args.lr,
        optimizer=args.optimizer,
        scheduler=args.scheduler,
        warmup_ratio=args.warmup_ratio,
        loss_fn=args.loss_fn,
        loss_weight=args.loss_weight,
        gamma=args.gamma,
        steps=args.steps,
        device=args.device,
        loader_workers=args.loader_workers,
        seed=args.seed,
    )
    metrics_path = args.out / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    budget = common.TimeBudget(
        start=start,
        deadline=cap.deadline,
        marks=common.budget_marks(args.minutes, args.save_at),
        metrics_path=metrics_path,
        warmup_ratio=recipe.warmup_ratio,
        fit_horizon=args.steps is None,
        console=lambda m, step: print(
            f"step {step}: loss {m.get('loss', 0):.4f} acc {m.get('acc', 0):.4f}", flush=True
        ),
    )
    train_start = time.perf_counter()
    trainer, train_config = sp.train_speculators(recipe, budget)
    train_s = time.perf_counter() - train_start
    steps = int(trainer.global_step)
    final = {
        "step": steps,
        "elapsed_s": round(time.perf_counter() - start, 3),
        "uri": str(save_dir / f"step{steps}"),
    }
    checkpoints = [c for c in budget.saved if c["step"] != steps] + [final]
    slots = sp.slot_accuracy(trainer, args.slot_rows)
    for c in checkpoints:
        name = "final" if c is final else f"step{c['step']}"
        c["export"] = str(
            weights.export_checkpoint(Path(c["uri"]), cfg, args.target, args.out / "export" / name)
        )

    packed_rows = len(trainer.train_loader)  # packed rows (steps) per epoch
    summary = {
        "name": "speculators_dflash",
        "provenance": provenance()
        | {"speculators": speculators.__dict__.get("__version__") or common.package_version("speculators")},
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "speculators_argv": list(train_config.argv),
        "speculators_config": json.loads(json.dumps(train_config.flatten(), default=str)),
        "target_layer_ids": layer_ids,
        "rows": len(rows),
        "rows_captured": captured,
        "capture_s": round(capture_s, 3),
        "train_s": round(train_s, 3),
        "total_s": round(time.perf_counter() - start, 3),
        "steps": steps,
        "stopped_by": budget.stopped_by,
        "horizon_steps": args.steps or budget.horizon,
        "steps_per_epoch": packed_rows,
        "tokens_seen_estimate": round(
            steps * common.mean_row_tokens(rows[:captured]) * (captured - 1) / max(1, packed_rows)
        ),
        "epochs": round(steps / max(1, packed_rows), 3),
        "last_metrics": budget.last,
        **common.metrics_tail(metrics_path),
        "slot_accuracy": slots,
        "checkpoints": checkpoints,
        "speculators_pieces": [
            "speculators.train.config.TrainConfig.resolve (its `speculators train` flags)",
            "speculators.train.cli.main: verifier-derived draft config, DFlashDraftModel.from_training_args",
            "build_speculator_training_dataset (pre-tokenized rows), ArrowDataset + FileTransfer, CollateFn, "
            "MultipackDistributedBatchSamplerV2",
            "DFlashDraftModel forward: anchors, anchor-block mask, targets from the verifier's last hidden state, "
            "compute_metrics (CE, D-PACE)",
            "build_optimizers (Muon + AdamW), transformers' schedules, Trainer.train_epoch, SingleGPUCheckpointer",
        ],
    }
    (args.out / "speculators_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("capture_s", "train_s", "steps", "slot_accuracy")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
