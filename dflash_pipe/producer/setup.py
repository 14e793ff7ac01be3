"""Everything resolved before the producer serves: target, tokenizer, data, drafter config, resume point."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_pipe.config import RunConfig
from dflash_pipe.data import LoadedData, Sample, load_samples
from dflash_pipe.drafter import DrafterConfig
from dflash_pipe.train.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.train.ledger import Ledger

CONFIG_FILE = "config.json"


class RunDirError(ValueError):
    """The run directory does not fit what was asked (fresh run over an old one, resume of nothing)."""


@dataclass(slots=True)
class RunContext:
    cfg: RunConfig
    run_id: str
    target_path: Path
    tokenizer: object
    data: LoadedData
    train_samples: list[Sample]
    eval_samples: list[Sample]
    drafter: DrafterConfig
    target_dtype: torch.dtype
    ledger: Ledger
    resume_from: Path | None
    resume_step: int


def prepare_run(cfg: RunConfig, *, resume: bool, progress: bool | None = None) -> RunContext:
    from transformers import AutoConfig, AutoTokenizer

    run_dir = cfg.run_dir
    _check_run_dir(run_dir, resume=resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    target_path = cfg.target_model
    if target_path is None:
        from dflash_pipe.target import build_demo_target

        target_path = build_demo_target(progress=progress)
    if not (Path(target_path) / "config.json").exists():
        raise FileNotFoundError(
            f"--target-model {target_path}: no config.json there. Pass a Hugging Face model directory "
            "(config.json + safetensors + tokenizer)."
        )
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    target_config = AutoConfig.from_pretrained(str(target_path))
    data = load_samples(cfg.data, tokenizer, progress=progress)
    n_eval = min(cfg.eval_samples, len(data.samples) // 10)
    train_samples = data.samples[: len(data.samples) - n_eval]
    # The held-out tail is the eval set, so training sample ids stay dense (0..N-1) for plans and the ledger.
    eval_samples = data.samples[len(data.samples) - n_eval :]
    opts = cfg.drafter
    drafter = DrafterConfig.from_target(
        target_config,
        tokenizer=tokenizer,
        num_layers=opts.num_layers,
        block_size=opts.block_size,
        mask_token_id=opts.mask_token_id,
        target_layer_ids=opts.target_layer_ids,
        attention_backend=opts.attention_backend,
        max_anchors=opts.max_anchors,
    )
    ledger = Ledger(len(train_samples), cfg.train.epochs)
    resume_from, resume_step = None, 0
    if resume:
        resume_from = latest_checkpoint(run_dir)
        if resume_from is not None:
            state = read_trainer_state(resume_from)
            ledger = Ledger.from_dict(state.ledger)
            resume_step = state.step
            if ledger.num_samples != len(train_samples):
                raise RunDirError(
                    f"--resume {run_dir}: the checkpoint was trained on {ledger.num_samples} samples but the data "
                    f"now gives {len(train_samples)}. Resume with the same --data and settings."
                )
    cfg.save(run_dir / CONFIG_FILE)
    return RunContext(
        cfg=cfg,
        run_id=f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
        target_path=Path(target_path),
        tokenizer=tokenizer,
        data=data,
        train_samples=train_samples,
        eval_samples=eval_samples,
        drafter=drafter,
        target_dtype=torch.bfloat16 if cfg.layout.device == "cuda" else torch.float32,
        ledger=ledger,
        resume_from=resume_from,
        resume_step=resume_step,
    )


def _check_run_dir(run_dir: Path, *, resume: bool) -> None:
    has_config = (run_dir / CONFIG_FILE).exists()
    if resume and not has_config:
        raise RunDirError(f"--resume {run_dir}: no {CONFIG_FILE} there, so there is no run to resume.")
    if not resume and has_config and (run_dir / "checkpoints").exists():
        raise RunDirError(
            f"--run-dir {run_dir} already holds a run with checkpoints. Continue it with "
            f"`dflash-pipe launch --resume {run_dir}`, or choose a new --run-dir."
        )


def load_run_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        raise RunDirError(f"--resume {run_dir}: no {CONFIG_FILE} there, so there is no run to resume.")
    return RunConfig.load(path)
