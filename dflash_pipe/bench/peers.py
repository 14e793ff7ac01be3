"""A peer trainer on the same rows: SpecForge's DFlash, offline, from features an HF forward captures.

SpecForge 0.2.0 (package ``specforge``) trains DFlash offline from ``.ckpt`` feature files; its own capture
needs SGLang, so ``capture_features`` writes the same records with an HF forward of the target. Training
then goes through SpecForge's own program path (``specforge.cli``'s ``train`` command, in-process): its
typed ``Config``, ``resolve_run`` / ``bind_run``, ``init_distributed``, ``build_application_run`` (its
offline reader, normalizer, collator, ``DFlashDraftModel``, ``OnlineDFlashModel`` loss, ``BF16Optimizer``
with its cosine-warm-up scheduler, ``Trainer`` / ``TrainerController``, ``CheckpointManager``), and the
export is its ``export_to_hf``. What this module adds is a wall-clock budget around ``Trainer.fit``
(``peer_common.TimeBudget``, hooked in as the trainer's logger through ``SpecForgeControl``), per-slot accuracy (SpecForge logs one accuracy over
all slots) and the two top-level config keys older DFlash loaders read.

Nothing of SpecForge is copied here: it is imported from the installed package, lazily
(``import_specforge``), so dflash-pipe does not depend on it.

What both peers share (rows, features, the budget, the scripts' flags) is in ``peer_common.py``; the
second peer, speculators, is ``speculators_peer.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_pipe.bench.peer_common import Row, TimeBudget, layer_features
from dflash_pipe.config.drafter import default_target_layer_ids

SPECFORGE_VERSION = "0.2.0"
"""The SpecForge release this driver was written against (its module paths and config fields)."""
FEATURE_NAME = "data_{index:08d}.ckpt"
"""One feature file per row; zero-padded so SpecForge's sorted listing is the row order."""
RUN_ID = "specforge-dflash"
"""SpecForge's run id: its checkpoints are ``OUT/train/{RUN_ID}-step{N}``."""


class SpecForgeMissingError(ImportError):
    """SpecForge (or one of the packages its trainer imports) is not installed."""


def import_specforge() -> Any:
    """The installed ``specforge`` package, or ``SpecForgeMissingError`` saying what to install."""
    try:
        import specforge
        from specforge.config import load_config  # noqa: F401  (pydantic, the config's first need)
    except ImportError as e:
        raise SpecForgeMissingError(
            f"SpecForge is not importable ({e}). Install it without its pins (they drag in sglang and another "
            f"torch): pip install --no-deps specforge=={SPECFORGE_VERSION}, plus the wheels listed in "
            "bench/peers/specforge_dflash.py's docstring"
        ) from e
    return specforge


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """dflash-pipe's default layer ids, checked equal to SpecForge's derivation (it has no other input for
    a target-derived draft config than the draft depth)."""
    from specforge.modeling.draft.dflash import build_target_layer_ids

    ours = list(default_target_layer_ids(num_target_layers, num_draft_layers))
    theirs = [int(i) for i in build_target_layer_ids(num_target_layers, num_draft_layers)]
    if ours != theirs:
        raise ValueError(
            f"layer ids differ for a {num_draft_layers}-layer drafter of a {num_target_layers}-layer target: "
            f"dflash-pipe {ours}, SpecForge {theirs}; pick a depth where they agree"
        )
    return ours


def capture_features(
    target: Any,
    rows: Sequence[Row],
    layer_ids: Sequence[int],
    out_dir: Path,
    *,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Write one SpecForge offline record per row: ``{input_ids [T], loss_mask [T], hidden_states [1, T,
    k*H]}``, the features being ``hidden_states[id + 1]`` of an HF forward concatenated on the last axis in
    the target's dtype (what SpecForge's SGLang capture stores, and what its DFlash normalizer reads).
    ``target``: the decoder (``model.model``: the LM head is not needed). Returns the rows written (fewer
    when ``should_stop`` says so first)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(target.parameters()).device
    written = 0
    with torch.inference_mode():
        for index, row in enumerate(rows):
            if should_stop():
                break
            ids = row.input_ids.to(device)
            out = target(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            feats = layer_features(out, layer_ids)  # [1, T, k*H]
            record = {
                "input_ids": row.input_ids.to(torch.long).clone(),
                "loss_mask": row.loss_mask.to(torch.long).clone(),
                "hidden_states": feats.cpu(),
            }
            torch.save(record, out_dir / FEATURE_NAME.format(index=index))
            written += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return written


@dataclass(kw_only=True, slots=True)
class PeerRecipe:
    """The training settings handed to SpecForge's config (its field names in the comments)."""

    target: Path
    """model.target_model_path: an HF model folder."""
    features: Path
    """data.hidden_states_path: the folder ``capture_features`` wrote."""
    out_dir: Path
    """output_dir: SpecForge's checkpoints land in ``{out_dir}/{RUN_ID}-step{N}``."""
    num_draft_layers: int = 5
    """model.draft_num_hidden_layers."""
    block_size: int = 16
    """model.draft_block_size."""
    mask_token_id: int
    """model.mask_token_id."""
    max_length: int = 3072
    """data.max_length."""
    lr: float = 6e-4
    """training.learning_rate."""
    warmup_ratio: float = 0.04
    """training.warmup_ratio."""
    max_grad_norm: float = 1.0
    """training.max_grad_norm."""
    num_anchors: int = 512
    """training.num_anchors."""
    gamma: float = 7.0
    """training.loss_decay_gamma."""
    batch_size: int = 1
    """training.batch_size (rows per step, padded)."""
    steps: int | None = None
    """training.max_steps: the schedule's horizon and a cap; None: fitted to the time budget (``TimeBudget``)."""
    device: str = "cuda"
    """cuda: bf16, flex attention, FSDP as SpecForge runs by default; cpu: fp32, SDPA, one-rank DDP."""
    seed: int = 0
    """training.seed."""
    loader_workers: int | None = None
    """data.dataloader_num_workers (None: SpecForge's default, 8 for DFlash)."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def specforge_config(self, *, horizon_guess: int) -> dict[str, Any]:
        """The run config as SpecForge's ``specforge train --config`` reads it (JSON form)."""
        cuda = self.device == "cuda"
        training: dict[str, Any] = {
            "strategy": "dflash",
            "num_epochs": 100_000,  # the time budget or max_steps ends the run
            "batch_size": self.batch_size,
            "learning_rate": self.lr,
            "lr_scheduler": "cosine",
            "warmup_ratio": self.warmup_ratio,
            "max_grad_norm": self.max_grad_norm,
            "num_anchors": self.num_anchors,
            "loss_decay_gamma": self.gamma,
            "attention_backend": "flex_attention" if cuda else "sdpa",
            # FSDP needs an accelerator; on one CPU rank SpecForge's NO_SHARD recipe (DDP) is the same step.
            "fsdp_sharding": "SHARD_GRAD_OP" if cuda else "NO_SHARD",
            "log_interval": 1,
            "save_interval": 0,
            "max_checkpoints": 0,
            "seed": self.seed,
        }
        if self.steps is not None:
            training["max_steps"] = self.steps
        else:
            training["total_steps"] = horizon_guess
        data: dict[str, Any] = {"hidden_states_path": str(self.features), "max_length": self.max_length}
        if self.loader_workers is not None:
            data["dataloader_num_workers"] = self.loader_workers
        return {
            "model": {
                "target_model_path": str(self.target),
                "draft_num_hidden_layers": self.num_draft_layers,
                "draft_block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "torch_dtype": "bfloat16" if cuda else "float32",
            },
            "data": data,
            "training": training,
            "tracking": {"report_to": "none"},
            "run_id": RUN_ID,
            "output_dir": str(self.out_dir),
        }


@dataclass(slots=True)
class SpecForgeControl:
    """SpecForge's ``Trainer`` as ``TimeBudget`` drives it (``peer_common.PeerControl``)."""

    trainer: Any

    def save(self, step: int) -> str | None:
        if self.trainer.last_checkpoint_step == step:
            return None
        return self.trainer.save_checkpoint().checkpoint_uri

    def stop(self, step: int) -> None:
        """``Trainer.fit`` then saves this step as the last checkpoint."""
        self.trainer._controller.max_steps = step

    def set_horizon(self, horizon: int, warmup: int) -> None:
        set_cosine_horizon(self.trainer.backend.optimizer, horizon=horizon, warmup=warmup)


def set_cosine_horizon(optimizer: Any, *, horizon: int, warmup: int) -> None:
    """Re-aim SpecForge's ``CosineAnnealingWarmupLR`` (still in its warm-up) at ``horizon`` steps: linear
    warm-up to step ``warmup``, cosine to zero at ``horizon``."""
    scheduler = optimizer.scheduler
    if getattr(scheduler, "finished", True):
        raise RuntimeError("the schedule already left its warm-up; pass --steps instead")
    scheduler.warmup_epochs = warmup
    scheduler.after_scheduler.T_max = max(1, horizon - warmup)


def train_specforge(
    recipe: PeerRecipe, budget: TimeBudget, config_path: Path, *, horizon_guess: int = 1_000_000
) -> Any:
    """SpecForge's ``specforge train --config CONFIG`` for one local rank, in this process, with ``budget``
    as the trainer's logger. Returns the trainer (after ``fit``) for the export and the per-slot accuracy;
    the caller closes the process group (``close_distributed``)."""
    import_specforge()
    from accelerate.utils import set_seed
    from specforge import cli
    from specforge.application import bind_run, build_application_run, resolve_run
    from specforge.config import load_config
    from specforge.distributed import init_distributed

    config_path.write_text(json.dumps(recipe.specforge_config(horizon_guess=horizon_guess), indent=2))
    cfg = load_config(str(config_path))
    resolved = resolve_run(cfg)
    role_config = cli._config_for_role(resolved.config, "all")
    run_cfg = bind_run(role_config, resolved.algorithm)
    os.environ["FSDP_SHARDING"] = run_cfg.config.training.fsdp_sharding
    set_seed(run_cfg.config.training.seed)
    cli._bootstrap_single_process_env()
    t = run_cfg.config.training
    init_distributed(
        timeout=t.dist_timeout,
        tp_size=t.tp_size,
        sp_ulysses_size=t.sp_ulysses_size,
        sp_ring_size=t.sp_ring_size,
    )
    run = build_application_run(run_cfg)
    trainer = run.trainer
    budget.console = trainer._controller.logger
    budget.trainer = SpecForgeControl(trainer)
    trainer._controller.logger = budget
    run.run()
    return trainer


def close_distributed() -> None:
    from specforge.distributed import destroy_distributed

    destroy_distributed()


def training_model(trainer: Any) -> Any:
    """SpecForge's ``OnlineDFlashModel`` inside its DDP / FSDP wrapper."""
    module = trainer.backend.module
    return getattr(module, "module", module)


def slot_accuracy(model: Any, features: Sequence[Path], device: torch.device) -> dict[str, Any]:
    """Per-slot accuracy of SpecForge's trained model on feature files, the way its loss counts accuracy
    (argmax of its LM head == the token at anchor + k, on supervised positions, its anchor sampling), kept
    per slot k = 1..bs-1 instead of summed over slots."""
    from specforge.runtime.data_plane.feature_store import load_feature_file

    block = int(model.block_size)
    correct = torch.zeros(block, dtype=torch.float64)
    counted = torch.zeros(block, dtype=torch.float64)
    was_training = model.training
    model.eval()
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for path in features:
            raw = load_feature_file(str(path))
            ids = raw["input_ids"].reshape(1, -1).to(device)
            mask = raw["loss_mask"].reshape(1, -1).to(device)
            hidden = raw["hidden_states"].reshape(1, ids.shape[1], -1).to(device, dtype)
            anchors, keep, out = model._forward_draft_blocks(
                input_ids=ids, hidden_states=hidden, loss_mask=mask
            )
            seq = ids.shape[1]
            idx = anchors.unsqueeze(-1) + torch.arange(block, device=device)  # [1, N, bs]
            valid = keep.unsqueeze(-1) & (idx < seq)
            idx = idx.clamp(max=seq - 1)
            labels = ids[0][idx]
            valid = valid & (mask[0][idx] > 0)
            logits = model.lm_head(out.reshape(1, anchors.shape[1], block, -1))
            hit = (logits.argmax(-1) == labels) & valid
            correct += hit.sum(dim=(0, 1)).double().cpu()
            counted += valid.sum(dim=(0, 1)).double().cpu()
    model.train(was_training)
    acc = (correct / counted.clamp(min=1)).tolist()[1:]
    return {
        "per_slot": [round(a, 4) for a in acc],
        "positions": int(counted[1].item()),
        "rows": len(features),
    }


def export_reference(checkpoint_uri: str, draft_config: Path, target: Path, out_dir: Path) -> Path:
    """SpecForge's ``export_to_hf`` of one checkpoint, plus the top-level ``block_size`` and
    ``num_target_layers`` older DFlash loaders read (its ``dflash_config`` keeps the rest)."""
    from specforge.export.to_hf import export_to_hf

    export_to_hf(checkpoint_uri, str(draft_config), str(out_dir), embedding_source=str(target))
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    dflash = config.setdefault("dflash_config", {})
    config.setdefault("block_size", int(dflash.get("block_size", config.get("block_size", 16))))
    config.setdefault(
        "num_target_layers", int(config.get("num_target_layers") or max(dflash["target_layer_ids"]) + 1)
    )
    config["architectures"] = ["DFlashDraftModel"]
    path.write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def write_draft_config(trainer: Any, path: Path) -> Path:
    """The resolved draft config (SpecForge derives it from the target) as the export needs it."""
    draft = training_model(trainer).draft_model
    draft.config.to_json_file(str(path))
    return path
