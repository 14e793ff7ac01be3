"""Everything resolved before the producer serves: target, tokenizer, data, drafter config, resume point.

``start_run`` resolves what does not need the data and starts tokenizing it in the background
(``PendingRun``); the launcher loads the target meanwhile and calls ``PendingRun.context()`` where the data
is needed (ledger, train/eval split, plans, WELCOME). ``prepare_run`` does both in one call.

The resumed checkpoint is read once, under the run dir's lock (``run.resume.ResumePoint``), and handed in.

Past 400 lines while the GGUF target and the MASK token's data check joined the set-up.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_pipe.compute.precision import compute_dtype
from dflash_pipe.config.drafter import (
    EngineConflictError,
    default_target_layer_ids,
    uncapturable_layers_error,
)
from dflash_pipe.config.mask_token import (
    MASK_TOKEN_KEY,
    MaskTokenError,
    given_mask_token,
    resolve_mask_token,
)
from dflash_pipe.data import DataFuture, LoadedData, Sample
from dflash_pipe.drafter import DrafterConfig
from dflash_pipe.run.config import DrafterOptions, RunConfig
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.files import RunDirError
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.run.resume import (
    NothingTrained,
    ResumePoint,
    RunComplete,
    check_resume,
    complete_message,
)
from dflash_pipe.target.gguf import TargetPathError, is_gguf, resolve_target

if TYPE_CHECKING:
    from dflash_pipe.producer.regen import Regeneration


class SetupError(ValueError):
    """A user input does not fit the run (flags vs the target); one line + the fix. The run dir's own
    errors are ``run.files.RunDirError``."""


class OptionsError(SetupError):
    """A drafter option does not fit the target model (layer ids, mask token)."""


GGUF_KEY = "gguf"
"""``DrafterConfig.extra`` key of a GGUF target: ``{"file": the GGUF file, "folder": its converted folder}``
(in every checkpoint's drafter config and in the export's ``dflash_pipe`` section)."""


def target_folder(target_model: Path | None) -> Path | None:
    """The Hugging Face folder of ``--target-model``: a GGUF file converted once (``target.gguf``), a folder
    as is, None for the demo target. A GGUF file that cannot be converted is a ``SetupError``."""
    try:
        return resolve_target(target_model)
    except TargetPathError as exc:
        raise SetupError(str(exc)) from None


@dataclass(slots=True)
class RunContext:
    cfg: RunConfig
    run_id: str
    target_path: Path
    tokenizer: object
    data: LoadedData
    train_samples: Sequence[Sample]
    """A run's ``StoredSamples`` (read from ``RUN_DIR/samples``), or a list."""
    eval_samples: Sequence[Sample]
    drafter: DrafterConfig
    target_dtype: torch.dtype
    ledger: Ledger
    resume_from: Path | None
    resume_step: int
    regen: Regeneration | None = None
    """With ``data.responses = "target"``: the regeneration; ``train_samples`` then holds None for every
    conversation not regenerated yet (sample id = conversation index), filled as the replies arrive."""
    notes: list[str] = field(default_factory=list)
    """What the launch says about the data before serving (e.g. too few samples to hold out an eval set)."""
    attached: bool = False
    """An attaching producer's context (``producer.attach``): the samples arrive in the coordinator's PLANs,
    so none is known before serving."""


@dataclass(slots=True)
class PendingRun:
    """A run resolved up to its data: target, tokenizer, drafter shape and resume point are known while the
    data file tokenizes in the background (``data``). The target can be loaded from it (``load_replicas``)
    meanwhile; ``context()`` waits for the data and completes the run. ``close()`` (or leaving a ``with``
    block) stops the tokenization if it still runs; safe after ``context()``."""

    cfg: RunConfig
    run_id: str
    target_path: Path
    tokenizer: object
    drafter: DrafterConfig
    target_dtype: torch.dtype
    data: DataFuture | None
    """The data tokenizing in the background; None with ``data.responses = "target"`` (``context()`` reads
    the conversations, which are tokenized once regenerated)."""
    resume: ResumePoint | None
    """The resumed checkpoint (None for a fresh run, or a resumed one that wrote none)."""

    def context(self) -> RunContext:
        """Waits for the data (raising its ``DataError``), then splits train/eval, builds or checks the ledger
        and saves the config into the run dir."""
        regen = None
        if self.data is None:
            regen = self._regeneration()
            data = LoadedData(
                samples=[],
                skipped_lines=regen.source.skipped_lines,
                truncated=0,
                dropped_short=0,
                skip_reasons=regen.source.skip_reasons,
                drop_reasons=regen.source.drop_reasons,
                notes=regen.source.notes,
            )
            train_samples, eval_samples = regen.train_samples, []  # eval: regenerated when serving starts
            total = len(regen.source.conversations)
        else:
            data = self.data.result()
            self.drafter = mask_unused_by_data(self.drafter, data.samples, self.tokenizer, self.cfg)
            total = len(data.samples)
            n_eval = held_out_count(self.cfg.eval_samples, total)
            train_samples = data.samples[: len(data.samples) - n_eval]
            # The held-out tail is the eval set, so training sample ids stay dense (0..N-1) for plans and the
            # ledger.
            eval_samples = data.samples[len(data.samples) - n_eval :]
        if self.resume is None:
            ledger = Ledger(len(train_samples), self.cfg.train.epochs)
        else:  # the mask token, known only now, must be the checkpoint's too
            self.resume.check_fits(self.drafter.to_dict(), self.cfg.run_dir)
            # --epochs may change on resume: more trains on (the checks ran in run.resume.check_resume)
            ledger = self.resume.ledger.with_epochs(self.cfg.train.epochs)
        if ledger.num_samples != len(train_samples):
            raise RunDirError(
                f"--resume {self.cfg.run_dir}: the checkpoint was trained on {ledger.num_samples} samples but "
                f"the data now gives {len(train_samples)}. Resume with the same --data and settings."
            )
        RunDir(self.cfg.run_dir).save_config(self.cfg)
        note = no_eval_note(self.cfg, total)
        return RunContext(
            cfg=self.cfg,
            run_id=self.run_id,
            target_path=self.target_path,
            tokenizer=self.tokenizer,
            data=data,
            train_samples=train_samples,
            eval_samples=eval_samples,
            drafter=self.drafter,
            target_dtype=self.target_dtype,
            ledger=ledger,
            resume_from=self.resume.checkpoint if self.resume is not None else None,
            resume_step=self.resume.step if self.resume is not None else 0,
            regen=regen,
            notes=[*data.notes, *([note] if note else [])],
        )

    def _regeneration(self) -> Regeneration:
        """The conversations to regenerate, with what the run dir's regenerated file already holds."""
        from dflash_pipe.data.conversations import check_prompts_fit, load_conversations
        from dflash_pipe.data.regenerated import RegenStore, provenance
        from dflash_pipe.producer.regen import Regeneration

        source = load_conversations(self.cfg.data, spill_dir=self.cfg.run_dir)
        check_prompts_fit(
            source, self.tokenizer, self.cfg.data
        )  # before the file is opened or any is generated
        n_eval = held_out_count(self.cfg.eval_samples, len(source.conversations))
        store = RegenStore(
            RunDir(self.cfg.run_dir).regenerated, provenance(self.target_path, self.cfg.data, self.cfg.regen)
        )
        return Regeneration(
            source,
            len(source.conversations) - n_eval,
            store,
            self.cfg.regen,
            self.cfg.data,
            self.tokenizer,
            seed=self.cfg.train.seed,
            spill_dir=self.cfg.run_dir,
        )

    def close(self) -> None:
        if self.data is not None:
            self.data.close()

    def __enter__(self) -> PendingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


EVAL_SHARE = 10
"""One sample in this many is held out for evaluation (at most ``eval_samples``)."""


def mask_unused_by_data(
    drafter: DrafterConfig, samples: Sequence[Sample], tokenizer: object, cfg: RunConfig
) -> DrafterConfig:
    """The drafter with a MASK token the data never contains: a MASK slot must not look like text. An
    automatic choice the data uses moves to the next candidate (``resolve_mask_token``); a
    ``--mask-token-id`` the data uses is refused (``OptionsError``)."""
    from dflash_pipe.data.samples import token_presence

    present = token_presence(samples, drafter.vocab_size)  # [vocab] bool
    mask = drafter.mask_token_id
    if not present[mask]:
        return drafter
    text = given_mask_token(tokenizer, mask).text
    shown = f" ({text!r})" if text is not None else ""
    if cfg.drafter.mask_token_id is not None:
        raise OptionsError(
            f"--mask-token-id {mask}: token {mask}{shown} appears in the training data ({cfg.data.path}), so "
            "the drafter could not tell a MASK slot from that text. Pass an id the data never contains, or "
            "leave the flag out to have one picked"
        )
    used = frozenset(int(i) for i in present.nonzero()[0])
    try:
        choice = resolve_mask_token(tokenizer, drafter.vocab_size, used=used)
    except MaskTokenError as exc:
        raise OptionsError(f"{exc} ({cfg.data.path} uses token {mask}{shown})") from None
    why = f"{choice.why}; {mask}{shown} is in the data ({cfg.data.path})"
    extra = {**drafter.extra, MASK_TOKEN_KEY: {**choice.to_dict(), "why": why}}
    return dataclasses.replace(drafter, mask_token_id=choice.id, extra=extra)


def held_out_count(eval_samples: int, total: int) -> int:
    """How many of ``total`` samples (the file's tail) are held out: one in ``EVAL_SHARE``, at most
    ``eval_samples``."""
    return min(eval_samples, total // EVAL_SHARE)


def no_eval_note(cfg: RunConfig, total: int) -> str | None:
    """One line when the data is too small to hold out an eval set (so no tau is ever measured), else None;
    nothing when ``--eval-samples 0`` asked for none."""
    if cfg.eval_samples == 0 or held_out_count(cfg.eval_samples, total) > 0:
        return None
    return (
        f"{cfg.data.path} has {total} sample(s), too few to hold out an eval set (one in {EVAL_SHARE} is held "
        f"out; {EVAL_SHARE} are needed for one): no held-out set, so no tau. Use a larger --data file to "
        "measure tau"
    )


def prepare_run(cfg: RunConfig, *, resume: bool, progress: bool | None = None) -> RunContext:
    """Everything resolved before the producer serves, data included (``start_run`` + ``context()``); a
    resume runs the launch's checks first (``check_resume``, without the run dir's lock)."""
    RunDir(cfg.run_dir).check(resume=resume)
    point = check_resume(cfg).resume if resume else None
    with start_run(cfg, resume=resume, point=point, progress=progress) as pending:
        return pending.context()


def start_run(
    cfg: RunConfig, *, resume: bool, point: ResumePoint | None = None, progress: bool | None = None
) -> PendingRun:
    """Checks the run dir, target and options against the resume point, with the data tokenizing in the
    background from the moment the tokenizer is loaded. Raises ``SetupError`` (the tokenization stopped).
    ``point``: the resumed checkpoint, read by the launch's checks (``run.resume.check_resume``); None for a
    fresh run or a resumed one that wrote none."""
    from transformers import AutoConfig, AutoTokenizer

    run_dir = RunDir(cfg.run_dir)
    run_dir.check(resume=resume)
    run_dir.root.mkdir(parents=True, exist_ok=True)
    target_path = target_folder(cfg.target_model)
    if target_path is None:
        from dflash_pipe.target import build_demo_target

        target_path = build_demo_target(progress=progress)
    # The target and the options first: a target or flag that cannot work stops before any work starts.
    target_config = AutoConfig.from_pretrained(str(target_path))
    check_target_family(target_config, target_path)
    opts = cfg.drafter
    check_options_fit_target(opts, target_config, target_path)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    data = None
    if cfg.data.responses == "dataset":  # on disk in the run dir (reused on resume), not in memory
        data = DataFuture(cfg.data, tokenizer, progress=progress, store=run_dir.samples)
    try:
        try:
            drafter = DrafterConfig.from_target(
                target_config,
                tokenizer=tokenizer,
                num_layers=opts.num_layers,
                block_size=opts.block_size,
                mask_token_id=opts.mask_token_id,
                target_layer_ids=opts.target_layer_ids,
                attention_backend=opts.attention_backend,
                max_anchors=opts.max_anchors,
                layer_types=opts.layer_types,
                sliding_window=opts.sliding_window,
            )
        except (EngineConflictError, MaskTokenError) as exc:  # before training: the engines could not serve
            raise OptionsError(f"{exc} (target: {target_path})") from None  # it, or no token can be MASK
        if is_gguf(cfg.target_model):  # which file the run's target folder came from
            drafter.extra[GGUF_KEY] = {
                "file": str(Path(cfg.target_model).resolve()),
                "folder": str(target_path),
            }
        if point is not None:  # the mask token once the data is known (PendingRun.context)
            point.check_fits(drafter.to_dict(), run_dir.root, skip=("mask_token_id",))
    except BaseException:
        if data is not None:
            data.close()
        raise
    return PendingRun(
        cfg=cfg,
        run_id=f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
        target_path=Path(target_path),
        tokenizer=tokenizer,
        drafter=drafter,
        target_dtype=compute_dtype(cfg.layout.device),
        data=data,
        resume=point,
    )


def check_target_family(target_config: object, target_path: Path) -> None:
    """A target dflash-pipe cannot take features from is refused from its config, naming its model type."""
    from dflash_pipe.target.families import UnsupportedTargetError, plan_target

    try:
        plan_target(target_config)
    except UnsupportedTargetError as exc:
        raise SetupError(f"--target-model {target_path}: {exc}") from None


def check_options_fit_target(opts: DrafterOptions, target_config: object, target_path: Path) -> None:
    """--target-layer-ids, --draft-layers and --mask-token-id checked against the target, with errors naming
    the flag; a feature layer the serving engines cannot capture (the last) is refused here too."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    layers, vocab = int(tc.num_hidden_layers), int(tc.vocab_size)
    ids = opts.target_layer_ids
    if ids is None:
        spread = default_target_layer_ids(layers, opts.num_layers)
        if list(spread) != sorted(set(spread)) or not 0 <= spread[0] <= spread[-1] < layers:
            most = 1 if layers <= 4 else layers - 3
            raise OptionsError(
                f"--draft-layers {opts.num_layers}: the target at {target_path} has only {layers} layers, too "
                f"few to spread {opts.num_layers} feature layers over (the default picks {list(spread)}). Pass "
                f"--draft-layers {most} or fewer, or --target-layer-ids with {opts.num_layers} distinct "
                f"increasing ids in 0-{layers - 1}"
            )
    else:
        bad = [i for i in ids if not 0 <= i < layers]
        if bad:
            raise OptionsError(
                f"--target-layer-ids {','.join(map(str, ids))}: layer(s) {bad} do not exist; the target at "
                f"{target_path} has {layers} layers (ids 0-{layers - 1}). Pick ids in that range, or leave the "
                "flag out for the even-spread default"
            )
        if list(ids) != sorted(set(ids)):
            raise OptionsError(
                f"--target-layer-ids {','.join(map(str, ids))}: give each layer once, in increasing order "
                f"(e.g. {','.join(map(str, sorted(set(ids))))})"
            )
        uncapturable = uncapturable_layers_error(ids, layers)
        if uncapturable is not None:
            raise OptionsError(f"{uncapturable} (target: {target_path})")
    if opts.mask_token_id is not None and not 0 <= opts.mask_token_id < vocab:
        raise OptionsError(
            f"--mask-token-id {opts.mask_token_id}: the target at {target_path} has a vocabulary of {vocab} "
            f"(ids 0-{vocab - 1}). Pass a reserved, unused token id below {vocab}, or leave the flag out to use "
            "the tokenizer's mask token"
        )


def check_open_work(ctx: RunContext) -> None:
    """After set-up, before the producer serves: a resumed run whose every epoch is trained (counting the
    regenerated conversations with nothing to train) raises ``RunComplete`` instead of serving nothing; a
    run at step 0 whose regenerated file (reused whole) leaves nothing to train raises ``NothingTrained``."""
    from dflash_pipe.producer.regen import first_open_epoch

    if not ctx.resume_step and ctx.regen is not None and (why := ctx.regen.nothing_to_train()):
        raise NothingTrained(f"{ctx.cfg.run_dir} trained 0 steps and has nothing to train: {why}")
    if ctx.resume_from is None:
        return
    voids = ctx.regen.voids if ctx.regen is not None else set()
    if first_open_epoch(ctx.ledger, voids) >= ctx.cfg.train.epochs:
        if message := complete_message(ctx.cfg, ctx.resume_from.name, ctx.resume_step, epochs_done=True):
            raise RunComplete(message)
        raise NothingTrained(
            f"{ctx.cfg.run_dir} trained 0 steps and its data has nothing left to train. Start a new --run-dir "
            "with data (or a --max-length) that gives samples"
        )
