"""The second peer trainer on the same rows: vllm-project/speculators' DFlash, offline, from features an HF
forward captures.

speculators 0.9.0 (package ``speculators``) trains DFlash from a ``datasets`` folder of pre-tokenized rows
(``input_ids``, ``loss_mask``, ``seq_len``) plus one ``hidden_states/hs_{i}.safetensors`` per row
(``token_ids`` [T], ``hidden_states`` [T, k+1, H]: the k feature layers, then the target's last layer
before its final norm, from which it rebuilds the target's logits). Its own capture needs vLLM, so
``capture_hidden_states`` writes the same files with an HF forward. Training goes through its own program
path (``speculators train``'s ``speculators.train.cli.main``, in-process): its typed ``TrainConfig`` from
the same flags, its draft built from the verifier (``--full-attention-indices`` on every layer: by default
every draft layer is sliding-window and causal in its block, which is not how DFlash drafts are served),
its packing data loader, ``DFlashDraftModel`` and loss, its optimizers and schedulers, its ``Trainer``. What
this module adds: ``BudgetTrainer`` (its ``Trainer`` with the wall-clock budget as the step callback, and a
CPU device where it assumes CUDA), the metrics its trainer logs, per-slot accuracy of the result, and the
export of its checkpoints to dflash-pipe's drafter format (``export_checkpoint``).

How its DFlash differs from ours is in docs/performance.md ("The speculators peer"); the CPU test
``tests/real/test_real_speculators_step.py`` shows the loss and gradients equal once those differences
are set alike. Nothing of speculators is copied here: it is imported lazily (``import_speculators``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_pipe.bench.peer_common import Row, TimeBudget, layer_features, scalars
from dflash_pipe.bench.speculators_weights import SPECULATORS_VERSION, speculators_layer_ids

HS_NAME = "hs_{index}.safetensors"
"""Its file backend's name for row ``index``'s hidden states (``hs_connectors.FileTransfer``)."""


class SpeculatorsMissingError(ImportError):
    """speculators (or one of the packages its trainer imports) is not installed."""


def import_speculators() -> Any:
    """The installed ``speculators`` package, or ``SpeculatorsMissingError`` saying what to install."""
    try:
        import speculators
        import speculators.train.cli  # noqa: F401  (its data loader: datasets, openai, hs_connectors)
    except ImportError as e:
        raise SpeculatorsMissingError(
            f"speculators is not importable ({e}). Install it without its pins (they move transformers and "
            f"datasets): pip install --no-deps speculators=={SPECULATORS_VERSION} plus the packages "
            "tests/real/speculators_site.py lists (or put that folder on PYTHONPATH)"
        ) from e
    return speculators


def write_dataset(rows: Sequence[Row], tokenizer: Any, data_dir: Path, *, max_length: int) -> int:
    """The rows as speculators' training dataset, through its own pre-tokenized path
    (``build_speculator_training_dataset``: truncation, rows without supervised tokens dropped), saved with
    ``save_to_disk`` where its loader reads it. Returns the rows kept (row i stays row i: ours all train)."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    raw = Dataset.from_dict(
        {
            "input_ids": [r.input_ids.tolist() for r in rows],
            "loss_mask": [r.loss_mask.long().tolist() for r in rows],
        }
    )
    built = build_speculator_training_dataset(raw, tokenizer, max_length=max_length, num_proc=1)
    if len(built) != len(rows):
        raise ValueError(
            f"speculators kept {len(built)} of {len(rows)} rows (it drops rows without supervised tokens); "
            "write the rows with dflash-pipe's loader (--conversations), which drops those first"
        )
    built.save_to_disk(str(data_dir))
    return len(built)


def capture_hidden_states(
    target: Any,
    rows: Sequence[Row],
    layer_ids: Sequence[int],
    data_dir: Path,
    *,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Write ``data_dir/hidden_states/hs_{i}.safetensors`` per row: ``token_ids`` [T] and ``hidden_states``
    [T, k+1, H] = our feature layers (``hidden_states[id + 1]``) then the last decoder layer's output before
    the final norm (read at the norm's input: HF's last ``hidden_states`` entry is after it), in the
    target's dtype. ``target``: the causal LM. Returns the rows written (fewer when ``should_stop`` says so
    first); the caller keeps only those rows in the dataset (``keep_rows``)."""
    from safetensors.torch import save_file

    out_dir = data_dir / "hidden_states"
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(target.parameters()).device
    last: list[torch.Tensor] = []
    hook = target.model.norm.register_forward_pre_hook(lambda _m, args: last.append(args[0]))
    written = 0
    try:
        with torch.inference_mode():
            for index, row in enumerate(rows):
                if should_stop():
                    break
                last.clear()
                out = target.model(
                    input_ids=row.input_ids.to(device)[None], output_hidden_states=True, use_cache=False
                )
                feats = layer_features(out, layer_ids)[0]  # [T, k*H]
                hidden = torch.cat([feats, last[0][0]], dim=-1).view(feats.shape[0], len(layer_ids) + 1, -1)
                record = {
                    "token_ids": row.input_ids.to(torch.long).contiguous(),
                    "hidden_states": hidden.cpu(),
                }
                save_file(record, str(out_dir / HS_NAME.format(index=index)))
                written += 1
    finally:
        hook.remove()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return written


def keep_rows(data_dir: Path, count: int) -> None:
    """Cut the saved dataset to its first ``count`` rows (those the capture reached)."""
    from datasets import load_from_disk

    data = load_from_disk(str(data_dir))
    if count < len(data):
        kept = data.select(range(count))
        tmp = data_dir.with_name(data_dir.name + ".kept")
        kept.save_to_disk(str(tmp))
        for path in data_dir.iterdir():
            if path.name != "hidden_states":
                path.unlink()
        for path in tmp.iterdir():
            path.rename(data_dir / path.name)
        tmp.rmdir()


class MetricsTap(logging.Handler):
    """Receives what its trainer logs to ``speculators.metrics`` each step (``{"train": {...}, "lr": ...,
    "global_step": N}``) and hands it to the budget, named as SpecForge's are (``loss``, ``acc``, plus its
    per-slot ``position_{k}_acc``)."""

    def __init__(self, budget: TimeBudget) -> None:
        super().__init__(level=logging.INFO)
        self.budget = budget

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if not isinstance(message, dict) or "train" not in message:
            return
        train = scalars(message["train"])
        metrics = dict(train)
        metrics["acc"] = train.get("full_acc", 0.0)
        lr = message.get("lr")
        if isinstance(lr, (int, float)):
            metrics["lr"] = float(lr)
        # its global_step counts from 0 before the step; the budget counts steps done
        self.budget(metrics, int(message["global_step"]) + 1)


@dataclass(kw_only=True, slots=True)
class SpeculatorsRecipe:
    """The run as ``speculators train`` flags (its flag names in the comments); defaults are its DFlash
    recipe (5 layers, block 16, CE on the target's argmax, D-PACE slot weights, Muon, linear schedule) except
    that every layer attends as DFlash's do (full attention, bidirectional in the block)."""

    target: Path
    """--verifier-name-or-path: an HF model folder (its embedding, LM head and final norm are read)."""
    data_dir: Path
    """--data-path: the folder ``write_dataset`` and ``capture_hidden_states`` wrote."""
    save_dir: Path
    """--save-path: its checkpoints (``step{N}/``) and the resolved ``run.yaml``."""
    target_layer_ids: list[int]
    """Our feature layer ids (passed to it as ``--target-layer-ids`` id + 1)."""
    mask_token_id: int
    rows: int
    """Rows in the dataset (its validation split takes the last one, the least it allows)."""
    num_draft_layers: int = 5
    block_size: int = 16
    total_seq_len: int = 8192
    """--total-seq-len: tokens packed into one step's row."""
    max_anchors: int = 512
    """--max-anchors: blocks per packed row (not per sequence, as ours)."""
    lr: float = 1e-3
    optimizer: str = "muon"
    scheduler: str = "linear"
    warmup_ratio: float = 0.01
    """--scheduler-warmup-ratio (its default: 1% of the horizon)."""
    loss_fn: str = "ce"
    loss_weight: str = "dpace"
    """--per-position-loss-weight: dpace (its DFlash default) or fixed-exp-decay (exp(-(k-1)/gamma))."""
    gamma: float = 7.0
    """--dflash-decay-gamma (used by fixed-exp-decay)."""
    steps: int | None = None
    """--max-steps; None: the horizon is fitted to the time budget."""
    device: str = "cuda"
    """cuda: bf16 autocast, flex attention, fused loss (its defaults); cpu: fp32, SDPA, eager loss."""
    loader_workers: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        if self.rows < 2:
            raise ValueError(
                f"speculators holds out at least one row for validation: need >= 2 rows, got {self.rows}"
            )

    def argv(self, *, horizon_guess: int) -> list[str]:
        """The ``speculators train`` command line (without the program name)."""
        cuda = self.device == "cuda"
        flags: dict[str, Any] = {
            "speculator-type": "dflash",
            "verifier-name-or-path": self.target,
            "data-path": self.data_dir,
            "save-path": self.save_dir,
            "log-dir": self.save_dir / "speculators-log",  # its logger's folder, not a run dir's
            "num-layers": self.num_draft_layers,
            "full-attention-indices": list(range(self.num_draft_layers)),
            "block-size": self.block_size,
            "target-layer-ids": speculators_layer_ids(self.target_layer_ids),
            "mask-token-id": self.mask_token_id,
            "total-seq-len": self.total_seq_len,
            "max-anchors": self.max_anchors,
            "lr": self.lr,
            "optimizer": self.optimizer,
            "scheduler-type": self.scheduler,
            "scheduler-warmup-ratio": self.warmup_ratio,
            "loss-fn": self.loss_fn,
            "per-position-loss-weight": self.loss_weight,
            "dflash-decay-gamma": self.gamma,
            "epochs": 100_000,  # the time budget or --max-steps ends the run
            "num-workers": self.loader_workers,
            "train-data-ratio": (self.rows - 0.5) / self.rows,
            "hidden-states-dtype": "bfloat16" if cuda else "float32",
            "draft-attn-impl": "simple_flex_attention" if cuda else "sdpa",
            "loss-implementation": "fused" if cuda else "eager",
            "on-missing": "raise",
            "log-freq": 1,
            "seed": self.seed,
        }
        if self.steps is not None:
            flags["max-steps"] = self.steps
        else:
            flags["scheduler-total-steps"] = horizon_guess
        argv = ["--no-resume-from-checkpoint"]
        for name, value in flags.items():
            values = value if isinstance(value, list) else [value]
            argv += [f"--{name}", *(str(v) for v in values)]
        return argv


@dataclass(slots=True)
class SpeculatorsControl:
    """speculators' ``Trainer`` as ``TimeBudget`` drives it (``peer_common.PeerControl``)."""

    trainer: Any
    stopped: bool = False
    saved_steps: set[int] = field(default_factory=set)

    def save(self, step: int) -> str | None:
        """Its checkpointer's save (the model in bf16 as it saves by default, its optimizer state) to
        ``SAVE/step{N}``."""
        if step in self.saved_steps:
            return None
        t = self.trainer
        t.checkpointer.save_checkpoint(t.model, t.optimizers, f"step{step}")
        self.saved_steps.add(step)
        return str(t.checkpointer.path / f"step{step}")

    def stop(self, step: int) -> None:
        self.trainer.config = self.trainer.config._replace(max_steps=step)
        self.stopped = True

    def set_horizon(self, horizon: int, warmup: int) -> None:
        """Its schedulers are transformers' ``LambdaLR``s of a ``partial``; the same function with the new
        step counts gives, from the next step on, the LRs it gives when built for ``horizon``."""
        for scheduler in self.trainer.schedulers:
            lambdas = []
            for fn in scheduler.lr_lambdas:
                if not isinstance(fn, functools.partial) or "num_training_steps" not in fn.keywords:
                    raise RuntimeError(f"cannot re-aim the schedule {fn!r}: pass --steps instead")
                keywords = fn.keywords | {"num_warmup_steps": warmup, "num_training_steps": horizon}
                lambdas.append(functools.partial(fn.func, *fn.args, **keywords))
            scheduler.lr_lambdas = lambdas


def train_speculators(
    recipe: SpeculatorsRecipe, budget: TimeBudget, *, horizon_guess: int = 1_000_000
) -> Any:
    """``speculators train FLAGS`` (its ``cli.main``) in this process, its ``Trainer`` replaced by one whose
    epoch loop runs under ``budget``. Returns (the trainer, the resolved ``TrainConfig``)."""
    import_speculators()
    from speculators.train import cli
    from speculators.train import trainer as trainer_module
    from speculators.train.config import TrainConfig
    from speculators.train.trainer import Trainer

    built: list[Any] = []
    tap = MetricsTap(budget)
    device = torch.device("cpu") if recipe.device == "cpu" else None

    class BudgetTrainer(Trainer):
        """Its trainer, run for the budget: the epoch loop stops when the budget says (without the per-epoch
        validation and checkpoint: the budget saves at its marks and at the end). On CPU its device is the
        CPU (it moves the model and batches to ``local_rank``, an accelerator index) and its step timer
        times the host (``HostStepTimer``)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(self)
            super().__init__(*args, **kwargs)
            self.control = SpeculatorsControl(self)
            budget.trainer = self.control
            logging.getLogger("speculators.metrics").addHandler(tap)

        @property
        def local_rank(self) -> Any:
            return device if device is not None else self._local_rank

        @local_rank.setter
        def local_rank(self, value: Any) -> None:
            self._local_rank = value

        def run_training(self) -> None:
            for epoch in range(self.current_epoch, self.config.num_epochs):
                self.train_epoch(epoch)
                if self.control.stopped or (
                    self.config.max_steps and self.global_step >= self.config.max_steps
                ):
                    break
            self.control.save(self.global_step)

    class HostStepTimer(trainer_module._StepTimer):
        """Its step timer, timing the host: it synchronizes the accelerator at each mark, and has none on CPU."""

        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    cfg = TrainConfig.resolve(recipe.argv(horizon_guess=horizon_guess))
    originals = (cli.Trainer, trainer_module._StepTimer)
    cli.Trainer = BudgetTrainer
    if device is not None:
        trainer_module._StepTimer = HostStepTimer
    try:
        cli.main(cfg)
    finally:
        cli.Trainer, trainer_module._StepTimer = originals
        logging.getLogger("speculators.metrics").removeHandler(tap)
    if not built:
        raise RuntimeError("speculators' train entry returned without building its trainer (a --dry-run?)")
    return built[0], cfg


def slot_accuracy(trainer: Any, rows: int) -> dict[str, Any]:
    """Per-slot accuracy of the trained model on the last ``rows`` training rows, each alone, as its own
    metrics count it (argmax == the target's argmax at anchor + k, on supervised positions, its anchors)."""
    from speculators.train.data import CollateFn

    model, dataset = trainer.model, trainer.train_loader.dataset
    block = int(model.block_size)
    correct = torch.zeros(block, dtype=torch.float64)
    counted = torch.zeros(block, dtype=torch.float64)
    kwargs = trainer.config.val_call_kwargs or {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for index in range(max(0, len(dataset) - rows), len(dataset)):
            item = dataset[index]
            collate = CollateFn(
                int(item["input_ids"].numel()),
                model.config.transformer_layer_config.hidden_size,
                num_target_layers=len(model.target_layer_ids),
                dtype=dataset.hidden_states_dtype,
            )
            batch = {
                k: v.to(trainer.local_rank) if isinstance(v, torch.Tensor) else v
                for k, v in collate([item]).items()
            }
            with torch.autocast(trainer.device_type, dtype=trainer.config.hidden_states_dtype):
                _, _, metrics = model(**batch, **kwargs)
            for k in range(1, block):
                correct[k] += float(metrics[f"position_{k}_acc_sum"])
                counted[k] += float(metrics[f"position_{k}_acc_total"])
    model.train(was_training)
    acc = (correct / counted.clamp(min=1)).tolist()[1:]
    return {
        "per_slot": [round(a, 4) for a in acc],
        "positions": int(counted[1].item()),
        "rows": min(rows, len(dataset)),
    }
