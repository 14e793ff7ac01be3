"""From ``dflash-pipe launch`` flags to one validated RunConfig (fresh run or resume)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from dflash_pipe.config import DrafterOptions, RunConfig, WireConfig
from dflash_pipe.data import DataConfig, demo_data_path
from dflash_pipe.layout import LayoutConfig, parse_gpu_spec
from dflash_pipe.train.config import TrainConfig

DEMO_DEFAULTS: dict[str, Any] = {
    "draft_layers": 3,
    "max_anchors": 32,
    "epochs": 1,
    "token_budget": 2048,
    "max_length": 512,
    "checkpoint_every": 100,
}
RESUME_OVERRIDES = {
    "peer_timeout",
    "max_steps",
    "device",
    "target_gpus",
    "drafter_gpus",
    "workers",
    "live",
    "epochs",
}
"""Flags that may change on --resume; everything else comes from the run's saved config."""


def build_run_config(opts: dict[str, Any]) -> tuple[RunConfig, bool]:
    if opts.get("resume_dir"):
        return _resume_config(opts), True
    demo = opts.get("target_model") is None
    if demo:
        for key, value in DEMO_DEFAULTS.items():
            if opts.get(key) is None:
                opts[key] = value
    data_path = opts.get("data_path")
    if data_path is None:
        if not demo:
            raise ValueError("--data is needed with --target-model (a JSONL file of conversations).")
        data_path = demo_data_path()
    run_dir = opts.get("run_dir") or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    cfg = RunConfig(
        run_dir=run_dir,
        target_model=opts.get("target_model"),
        data=DataConfig(
            path=Path(data_path),
            **_pick(
                opts, token_budget="token_budget", max_length="max_length", skip_bad_lines="skip_bad_lines"
            ),
        ),
        drafter=DrafterOptions(
            **_pick(
                opts,
                num_layers="draft_layers",
                block_size="block_size",
                mask_token_id="mask_token_id",
                max_anchors="max_anchors",
                attention_backend="attention_backend",
                target_layer_ids="target_layer_ids",
            )
        ),
        train=TrainConfig(
            **_pick(
                opts,
                epochs="epochs",
                max_steps="max_steps",
                lr="lr",
                seed="seed",
                compile="compile_mode",
                checkpoint_every="checkpoint_every",
                eval_every="eval_every",
            )
        ),
        wire=WireConfig(**_pick(opts, bind="bind", peer_timeout_s="peer_timeout")),
        layout=_layout(opts),
        **_pick(opts, eval_samples="eval_samples"),
    )
    return cfg, False


def _resume_config(opts: dict[str, Any]) -> RunConfig:
    from dflash_pipe.producer.setup import load_run_config

    given = {k for k, v in opts.items() if v not in (None, False, "auto", 2) and k != "resume_dir"}
    fixed = sorted(given - RESUME_OVERRIDES - {"run_dir"})
    if fixed:
        flags = ", ".join("--" + k.replace("_", "-") for k in fixed)
        raise ValueError(f"--resume uses the run's saved config; {flags} cannot change on resume.")
    cfg = load_run_config(Path(opts["resume_dir"]))
    if opts.get("max_steps") is not None:
        cfg.train.max_steps = opts["max_steps"]
        cfg.train.__post_init__()
    if opts.get("peer_timeout") is not None:
        cfg.wire.peer_timeout_s = opts["peer_timeout"]
        cfg.wire.__post_init__()
    if opts.get("epochs") is not None:
        cfg.train.epochs = opts["epochs"]
        cfg.train.__post_init__()
    if any(opts.get(k) not in (None, "auto") for k in ("device", "target_gpus", "drafter_gpus")):
        cfg.layout = _layout(opts)
    return cfg


def _layout(opts: dict[str, Any]) -> LayoutConfig:
    device = opts.get("device") or "auto"
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return LayoutConfig(device="cpu", cpu_workers=opts.get("workers") or 2)
    target, drafter = opts.get("target_gpus"), opts.get("drafter_gpus")
    if target is None and drafter is None:
        import torch

        n = torch.cuda.device_count()
        target, drafter = ("0", "0") if n == 1 else ("0", f"1-{n - 1}")
        if n == 1:
            warnings.warn("One GPU: the target and the drafter worker share it.", stacklevel=2)
    if target is None or drafter is None:
        raise ValueError("Give both --target-gpus and --drafter-gpus (e.g. 0-4 and 5-7).")
    return LayoutConfig(
        device="cuda",
        target_gpus=parse_gpu_spec(target, flag="--target-gpus"),
        drafter_gpus=parse_gpu_spec(drafter, flag="--drafter-gpus"),
    )


def _pick(opts: dict[str, Any], **names: str) -> dict[str, Any]:
    """Config field -> CLI option name, keeping only the options the user (or a default) set."""
    out = {}
    for field, option in names.items():
        value = opts.get(option)
        if value is None or value is False:
            continue
        if field == "target_layer_ids":
            value = tuple(int(x) for x in str(value).split(","))
        out[field] = value
    return out
