"""Configuration of the data stage: where the samples come from and how they are cut."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash_pipe.fields import check_choice, flag


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the training data is and how it is cut into samples and batches."""

    path: Path = field(
        metadata=flag(
            "--data",
            "Training data: a JSONL file; a parquet or arrow file, or a folder or glob of their shards; a "
            "datasets save_to_disk folder; or a Hugging Face dataset id ORG/NAME[:SPLIT] read from the local "
            "datasets or Hub file cache only, never downloaded (tables need pip install 'dflash-pipe[data]'). Rows or lines in the "
            "messages, ShareGPT or input_ids+loss_mask format (default with the demo: bundled samples).",
            param="data_path",
        )
    )
    """The data (``sources.resolve_source``): a JSONL file (one conversation, messages / ShareGPT, or one
    pre-tokenized sample per line); parquet or arrow files (a file, a folder or a glob of shards), a
    ``datasets`` ``save_to_disk`` folder, or a Hub dataset id (``ORG/NAME``, ``ORG/NAME:SPLIT``,
    ``ORG/NAME:CONFIG:SPLIT``) in the local ``datasets`` or Hub file cache, whose rows have the same formats. Tables are read in
    record batches (docs/data.md)."""
    max_length: int = field(
        default=3072, metadata=flag("--max-length", "Longer samples are truncated (default 3072; demo 512).")
    )
    """Tokens per sample; longer samples are truncated (and counted in ``LoadedData.truncated``)."""
    token_budget: int = field(
        default=4096,
        metadata=flag(
            "--token-budget",
            "Max tokens per batch (default 4096: one 3072-token sample with 512 anchors, or several short "
            "ones; demo 2048).",
        ),
    )
    """Maximum tokens per batch (sum of sample lengths); a longer single sample gets a batch of its own."""
    skip_bad_lines: bool = field(
        default=False,
        metadata=flag(
            "--skip-bad-lines", "Skip and count malformed data lines (or table rows) instead of stopping."
        ),
    )
    """Skip malformed lines or rows (counted per reason) instead of raising ``DataError`` on the first one."""
    min_loss_tokens: int = 2
    """Samples with fewer trainable anchor positions (p with loss_mask[p] and loss_mask[p+1]) are dropped."""
    tokenize_workers: int | None = field(
        default=None,
        metadata=flag(
            "--tokenize-workers",
            "Processes tokenizing --data in parallel, while the target loads (default: one per core but one; "
            "0 or 1: in-process; files under 4 MiB always in-process).",
            resume=True,
        ),
    )
    """Worker processes that tokenize the file in parallel (pieces of lines, merged in file order, so the
    samples are the same as in-process). None: one per CPU core but one, at most 16; 0 or 1: in-process.
    Files under 4 MiB are always tokenized in-process (starting a worker costs more than it saves)."""
    responses: Literal["dataset", "target"] = field(
        default="dataset",
        metadata=flag(
            "--responses",
            "Train on the data's assistant turns, or on the target's own replies: it regenerates every turn "
            "first, turn by turn, while the drafters already train (default dataset; demo target).",
        ),
    )
    """Which assistant turns are trained: "dataset" as the file has them; "target": the target regenerates
    every assistant turn first, turn by turn (``RegenConfig``), and the drafter trains on what it said."""
    chat_template_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=flag(
            "--chat-template-arg",
            "Extra apply_chat_template argument for rendering and generation prompts, e.g. "
            "enable_thinking=false (VALUE read as JSON, else a string); repeatable.",
            multiple=True,
            metavar="KEY=VALUE",
        ),
    )
    """Extra arguments of ``apply_chat_template`` (e.g. ``{"enable_thinking": false}``), used to render the
    training text and the regeneration prompts."""

    def __post_init__(self) -> None:
        if isinstance(self.path, str):
            self.path = Path(self.path)
        if not isinstance(self.path, Path):
            raise ValueError(
                f"DataConfig.path must be a data path (JSONL, parquet, arrow, a save_to_disk folder) or a Hub "
                f"dataset id, got {self.path!r}"
            )
        if self.max_length < 2:
            raise ValueError(f"DataConfig.max_length must be >= 2, got {self.max_length}; use e.g. 3072")
        if self.token_budget < 1:
            raise ValueError(f"DataConfig.token_budget must be >= 1, got {self.token_budget}; use e.g. 16384")
        if self.min_loss_tokens < 0:
            raise ValueError(
                f"DataConfig.min_loss_tokens must be >= 0, got {self.min_loss_tokens}; use e.g. 2"
            )
        check_choice(
            self, "responses", "DataConfig.responses", "; use target to train on the target's own replies"
        )
        self.chat_template_kwargs = check_template_kwargs(self.chat_template_kwargs)
        if self.tokenize_workers is not None and self.tokenize_workers < 0:
            raise ValueError(
                f"DataConfig.tokenize_workers must be >= 0 (0 or 1: in-process) or None (automatic), got "
                f"{self.tokenize_workers}; leave it unset for one worker per core"
            )


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` as a plain JSON-able dict with string keys, or ValueError naming the fix."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise ValueError(
            f"data.chat_template_kwargs must be a mapping of argument names to values, got {value!r}; "
            'e.g. {"enable_thinking": false} (flag: --chat-template-arg enable_thinking=false)'
        )
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"data.chat_template_kwargs must hold JSON values (strings, numbers, booleans, lists), got {value!r}"
        ) from None
    return dict(value)


@dataclass(kw_only=True, slots=True)
class RegenConfig:
    """How the target regenerates assistant turns (``data.responses = "target"`` and ``dflash-pipe
    regenerate``). Every field but ``batch_size`` enters the regenerated file's provenance: a file made with
    other settings is not reused."""

    temperature: float = field(
        default=0.0, metadata=flag("--temperature", "Regeneration: 0 greedy (default), > 0 sampled.")
    )
    """0: greedy (the target's argmax, what lossless greedy speculative decoding serves); > 0: sampled."""
    top_p: float = field(
        default=1.0,
        metadata=flag("--top-p", "Regeneration: nucleus sampling threshold in (0, 1] (default 1)."),
    )
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: all)."""
    top_k: int = field(
        default=0, metadata=flag("--top-k", "Regeneration: sample among the k most likely tokens (0: all).")
    )
    """Keep only the k most likely tokens when sampling (0: no limit)."""
    seed: int = field(
        default=0, metadata=flag("--regen-seed", "Regeneration: sampling seed (per conversation and turn).")
    )
    """Seeds sampling per (conversation, turn): a turn's tokens do not depend on batching or resume."""
    max_new_tokens: int = field(
        default=1024,
        metadata=flag("--max-new-tokens", "Regeneration: tokens per assistant turn at most (default 1024)."),
    )
    """Tokens generated per assistant turn at most (also bounded by data.max_length); a turn cut here is
    kept and counted as truncated."""
    batch_size: int = field(
        default=0,
        metadata=flag(
            "--regen-batch",
            "Regeneration: conversations decoded together per target replica (default 0: auto, on a GPU as "
            "many slots of --max-length tokens as fit in half the memory free once the target is loaded, a "
            "quarter when drafters share its GPUs, at most 256; else 32).",
            resume=True,
        ),
    )
    """Conversations generated together: the slots of the slot engine (a job's conversations), or the rows
    of one batched decode per turn round on the plain path. 0: sized from free memory
    (``target.decode.sizing``)."""
    loops: Literal["keep", "drop"] = field(
        default="keep",
        metadata=flag(
            "--regen-loops",
            "Regeneration: keep (default) or drop replies that end in a loop (their last tokens one unit of "
            "up to 100 tokens repeated 3+ times, 32+ tokens; docs/data.md). drop ends the conversation "
            "before such a reply (its earlier turns are kept); both count them.",
        ),
    )
    """What becomes of a reply that ends in a loop (``data.loops``): "keep" trains on it as the target said
    it; "drop" ends its conversation before it (the earlier turns are kept, the turn counts as failed with
    reason ``looped``). Either way ``RegenTally.looped_turns`` counts it. In the provenance only when
    "drop" (files made before this setting existed are reused as "keep")."""
    decoder: Literal["auto", "engine", "plain"] = field(
        default="auto",
        metadata=flag(
            "--regen-decoder",
            "Regeneration: auto (the slot engine for dense and MoE Qwen/Llama/Mistral targets and hybrid "
            "Qwen3.5/3.6 and Qwen3-Next ones, else the plain path with one log line), engine (the slot "
            "engine or an error naming why the target cannot have it) or plain (the model's own forward per "
            "step, every family; slower).",
            resume=True,
        ),
    )
    """Which decoder writes the replies (docs/data.md). Not part of the provenance: each decodes the same
    tokens (the tests check each against HF ``generate``)."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(
                f"regen.temperature must be >= 0 (0: greedy), got {self.temperature}; use 0 or e.g. 0.7"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"regen.top_p must be in (0, 1], got {self.top_p}; use 1 for no nucleus cut")
        if self.top_k < 0:
            raise ValueError(f"regen.top_k must be >= 0 (0: no limit), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"regen.max_new_tokens must be >= 1, got {self.max_new_tokens}; use e.g. 1024")
        if self.batch_size < 0:
            raise ValueError(
                f"regen.batch_size must be >= 0 (0: auto), got {self.batch_size}; use 0 or e.g. 64"
            )
        check_choice(self, "decoder", "regen.decoder", "; auto uses the slot engine where it can")
        check_choice(self, "loops", "regen.loops", "; keep trains on looped replies, drop leaves them out")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def provenance(self) -> dict[str, Any]:
        """The settings that decide what is generated (``batch_size`` and ``decoder`` do not: see ``seed``;
        ``loops`` only when it drops, so a file made before it existed is still this run's)."""
        out = asdict(self)
        del out["batch_size"], out["decoder"]
        if self.loops == "keep":
            del out["loops"]
        return out
