"""The command that serves an exported drafter beside its target, every setting derived from the export.

What each engine reads, from its own code:

- vLLM (vllm-project/vllm): ``--speculative-config`` with ``method`` "dflash" (``vllm/config/speculative.py``:
  ``DFlashModelTypes``, ``use_dflash``), ``model`` the export and ``num_speculative_tokens`` = block_size - 1
  (vLLM does not read ``block_size``: the anchor slot is not a speculative token); a drafter that mixes
  sliding and full layers needs ``VLLM_USE_V2_MODEL_RUNNER=1`` (``vllm/model_executor/models/qwen3_dflash.py``
  ``_resolve_layer_attention`` raises NotImplementedError otherwise); server-wide chat template arguments
  are ``--default-chat-template-kwargs``.
- SGLang (sgl-project/sglang): ``--speculative-algorithm DFLASH``, ``--speculative-draft-model-path`` and
  ``--speculative-num-draft-tokens`` = block_size (``python/sglang/srt/speculative/dflash_worker.py``
  ``DFlashWorker.__init__`` reads ``server_args.speculative_num_draft_tokens`` as the block size and warns
  on a mismatch with the config's); chat template arguments travel with each request.
- The reference (z-lab/dflash ``dflash/model.py``, ``pip install 'dflash[local]'``):
  ``DFlashDraftModel.from_pretrained(EXPORT)`` and
  ``spec_generate(target=, input_ids=, max_new_tokens=, stop_token_ids=, temperature=)``; it reads the
  block size, feature layers and mask token from the export's config.json itself.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_pipe.config.drafter import SLIDING_ATTENTION, DrafterConfig
from dflash_pipe.run.dir import RunDir

ENGINES = ("vllm", "sglang", "reference")
REFERENCE_DEVICE = "cuda:0"
"""The device the reference snippet puts the target and the drafter on (its ``device = ...`` line)."""
TARGET_PLACEHOLDER = "TARGET_MODEL"
"""Printed where the target is unknown (an export does not record which target it was trained on)."""


@dataclass(frozen=True, slots=True)
class ServePlan:
    """What a serve command needs: the drafter's config, where its export is, the target and the chat
    template arguments it was trained with (None: not recorded)."""

    drafter: DrafterConfig
    export_dir: Path
    target: str
    chat_template_kwargs: dict | None
    export_first: str | None = None  # the export command to run first, when the path was a run/checkpoint

    @property
    def mixed_layers(self) -> bool:
        """Sliding and full layers in one stack (vLLM's V2 model runner only)."""
        types = self.drafter.layer_types
        return 0 < types.count(SLIDING_ATTENTION) < len(types)


def plan_from_export(export_dir: Path, *, target: str | None = None) -> ServePlan:
    """A plan from an export directory's config.json (read with the export module's reader)."""
    from .export import CONFIG_NAME, read_export_config

    export_dir = Path(export_dir)
    if not (export_dir / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"{export_dir}: no {CONFIG_NAME}; give a `dflash-pipe export` output directory or a run dir"
        )
    cfg = read_export_config(export_dir)
    raw = json.loads((export_dir / CONFIG_NAME).read_text())
    kwargs = (raw.get("dflash_config") or {}).get("chat_template_kwargs")
    return ServePlan(
        drafter=cfg,
        export_dir=export_dir,
        target=target or TARGET_PLACEHOLDER,
        chat_template_kwargs=dict(kwargs) if isinstance(kwargs, dict) else None,
    )


def run_settings(checkpoint: Path) -> tuple[str | None, dict | None]:
    """(target path, chat template arguments) of the run a checkpoint belongs to, from the run's saved
    config; (None, None) when the checkpoint is not inside a run dir or its config cannot be read."""
    run = RunDir.of_checkpoint(checkpoint)
    if run is None or not run.config.is_file():
        return None, None
    try:
        cfg = run.load_config()
    except ValueError:  # a damaged or other-version run config: the checkpoint still exports, unrecorded
        return None, None
    from dflash_pipe.target.gguf import converted_folder, is_gguf

    target = cfg.target_model
    if target is None:  # the built-in demo target, where launch builds it
        from dflash_pipe.target.demo import default_cache_dir

        target = default_cache_dir()
    elif is_gguf(target) and target.is_file():  # served from the folder the run converted it to
        target = converted_folder(target)
    return str(target), dict(cfg.data.chat_template_kwargs)


def plan_from_path(path: Path, *, target: str | None = None) -> ServePlan:
    """An export directory, or a run dir / checkpoint: its latest checkpoint's drafter config and the run's
    target and chat template arguments, served from the export ``dflash-pipe export PATH RUN/export``
    writes (printed as the step before; a checkpoint outside a run: STEP-export beside it)."""
    from dflash_pipe.run.files import DRAFTER_CONFIG
    from dflash_pipe.run.locate import find_checkpoint

    from .export import WEIGHTS_NAME

    path = Path(path)
    if (path / WEIGHTS_NAME).is_file():  # an export (a run dir and a checkpoint have other weights)
        return plan_from_export(path, target=target)
    ckpt = find_checkpoint(path)
    run_target, kwargs = run_settings(ckpt)
    cfg = DrafterConfig.from_dict(json.loads((ckpt / DRAFTER_CONFIG).read_text()))
    run = RunDir.of_checkpoint(ckpt)  # RUN/export for a run; beside a lone checkpoint (never inside it)
    out = run.export if run is not None else ckpt.with_name(f"{ckpt.name}-export")
    return ServePlan(
        drafter=cfg,
        export_dir=out,
        target=target or run_target or TARGET_PLACEHOLDER,
        chat_template_kwargs=kwargs,
        export_first=f"dflash-pipe export {shlex.quote(str(path))} {shlex.quote(str(out))}",
    )


def _json(value: object) -> str:
    return shlex.quote(json.dumps(value))


def _notes(plan: ServePlan) -> list[str]:
    notes = []
    if plan.target == TARGET_PLACEHOLDER:
        notes.append(
            f"# {TARGET_PLACEHOLDER}: the target the drafter was trained on (an export does not record it; "
            "pass --target, or give the run dir)"
        )
    return notes


def _template_note(plan: ServePlan, how: str) -> list[str]:
    kwargs = plan.chat_template_kwargs
    if kwargs is None:
        return [
            "# chat template arguments: not recorded in this export; serve with the ones the training data "
            "was rendered with (a drafter trained with thinking on accepts far less without it)"
        ]
    if not kwargs:
        return ["# chat template arguments: none (the drafter was trained with the template's defaults)"]
    return [f"# trained with chat template arguments {json.dumps(kwargs)}: {how}"]


def vllm_command(plan: ServePlan) -> list[str]:
    """``vllm serve TARGET --speculative-config '{"method": "dflash", ...}'`` and its notes."""
    cfg = plan.drafter
    spec = {"method": "dflash", "model": str(plan.export_dir), "num_speculative_tokens": cfg.block_size - 1}
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if plan.mixed_layers else ""
    lines = [f"{env}vllm serve {shlex.quote(plan.target)} \\", f"  --speculative-config {_json(spec)}"]
    if plan.chat_template_kwargs:
        lines[-1] += " \\"
        lines.append(f"  --default-chat-template-kwargs {_json(plan.chat_template_kwargs)}")
    notes = [
        f"# num_speculative_tokens {cfg.block_size - 1} = block_size {cfg.block_size} - 1 (vLLM does not read "
        "block_size: the block's first slot is the last accepted token)"
    ]
    if plan.mixed_layers:
        notes.append(
            "# sliding and full layers in one drafter: vLLM serves that only on its V2 model runner "
            "(VLLM_USE_V2_MODEL_RUNNER=1)"
        )
    notes.append(
        "# attention: the drafter's full_attention layers are non-causal; vLLM needs a backend that "
        "supports that for the draft (the DFlash README serves with --attention-backend flash_attn)"
    )
    notes += _template_note(plan, "passed above as --default-chat-template-kwargs")
    return lines + notes + _notes(plan)


def sglang_command(plan: ServePlan) -> list[str]:
    """``python -m sglang.launch_server --speculative-algorithm DFLASH ...`` and its notes."""
    cfg = plan.drafter
    lines = [
        f"python -m sglang.launch_server --model-path {shlex.quote(plan.target)} \\",
        "  --speculative-algorithm DFLASH \\",
        f"  --speculative-draft-model-path {shlex.quote(str(plan.export_dir))} \\",
        f"  --speculative-num-draft-tokens {cfg.block_size}",
    ]
    notes = [
        f"# --speculative-num-draft-tokens {cfg.block_size} = block_size (SGLang drafts the whole block, anchor "
        f"included); mask_token_id {cfg.mask_token_id} must be the target tokenizer's <|MASK|> id if it has one "
        "(SGLang refuses a mismatch)",
    ]
    kwargs = plan.chat_template_kwargs
    how = f'send them with every request: "chat_template_kwargs": {json.dumps(kwargs)}' if kwargs else ""
    notes += _template_note(plan, how)
    return lines + notes + _notes(plan)


def reference_command(plan: ServePlan) -> list[str]:
    """A Python snippet: the reference's ``DFlashDraftModel`` and its ``spec_generate`` next to the target.

    Written for the reference package as published (``dflash==0.1.0``; tests/drafter/test_reference_package.py
    runs it): its extra is ``local`` (torch, transformers), which has no ``accelerate``, so the models are
    moved with ``.to(device)`` rather than ``device_map``; transformers 5's ``apply_chat_template`` returns a
    BatchEncoding, so the prompt is rendered as text and tokenized to a tensor of ids."""
    kwargs = plan.chat_template_kwargs or {}
    template_args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    lines = [
        "# pip install 'dflash[local]'   (z-lab/dflash, the DFlash reference; its `local` extra: torch, transformers)",
        "from dflash import DFlashDraftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"device = {REFERENCE_DEVICE!r}",
        f"target = AutoModelForCausalLM.from_pretrained({str(plan.target)!r}, dtype='auto').to(device).eval()",
        f"draft = DFlashDraftModel.from_pretrained({str(plan.export_dir)!r}, dtype='auto').to(device).eval()",
        f"tokenizer = AutoTokenizer.from_pretrained({str(plan.target)!r})",
        "messages = [{'role': 'user', 'content': 'How many positive whole-number divisors does 196 have?'}]",
        f"text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True{template_args})",
        "input_ids = tokenizer(text, return_tensors='pt', add_special_tokens=False).input_ids.to(device)",
        "output = draft.spec_generate(",
        "    target=target, input_ids=input_ids, max_new_tokens=512, temperature=0.0,",
        "    stop_token_ids=[tokenizer.eos_token_id],",
        ")",
        "print(tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=False))",
        f"# the reference reads block_size {plan.drafter.block_size}, the feature layers and the mask token from "
        "the export's config.json",
    ]
    if plan.chat_template_kwargs is None:
        lines += _template_note(plan, "")
    return lines + _notes(plan)


COMMANDS: dict[str, Callable[[ServePlan], list[str]]] = {
    "vllm": vllm_command,
    "sglang": sglang_command,
    "reference": reference_command,
}


def serve_command(plan: ServePlan, engine: str) -> str:
    """The text ``serve-command`` prints: the export step when needed, then the engine's command and notes."""
    lines = [f"# first: {plan.export_first}"] if plan.export_first else []
    return "\n".join(lines + COMMANDS[engine](plan)) + "\n"
