"""``dflash-pipe regenerate``: only the regeneration step, for people who want the file.

The same ``TurnGenerator`` and regenerated-file format as a run with ``--responses target`` (so the output
trains as ``--data OUT --responses dataset``), on one device, resumable the same way: run the same command
again after a kill or Ctrl-C and only the conversations not in the file yet are generated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_pipe.data import DataConfig
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.conversations import load_conversations
from dflash_pipe.data.regenerated import Regenerated, RegenStore, RegenTally, provenance

CHUNK_SLOTS = 16
"""Conversations handed to the generator per call, in slots' worth: a slot whose conversation ends takes
the next one of the call at once (continuous batching), and each is written when it is done."""


@dataclass(slots=True)
class RegenerateSummary:
    out: Path
    conversations: int
    """Conversations in the source file."""
    reused: int
    """Already in the output file when the command started (not generated again)."""
    tally: RegenTally = field(default_factory=RegenTally)
    seconds: float = 0.0
    source_left_out: dict[str, int] = field(default_factory=dict)
    """Records of the source not read as conversations, by reason: bad lines skipped (``--skip-bad-lines``)
    and conversations with nothing to train."""
    notes: list[str] = field(default_factory=list)
    """How the source was read (a JSON array cut short, leading assistant turns left out)."""
    interrupted: bool = False
    """Ctrl-C stopped it: the conversations finished before are in ``out`` (``lines`` says how many)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tally.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        t = self.tally
        head = "interrupted: " if self.interrupted else ""
        again = "; run the same command again to generate the rest" if self.interrupted else ""
        return [
            f"{head}{self.out}: {self.reused + t.conversations}/{self.conversations} conversations "
            f"({t.conversations} generated now, {self.reused} already there){again}",
            f"turns generated {t.turns} ({t.truncated_turns} cut at the token limit: {t.capped_turns} at "
            f"--max-new-tokens; {t.looped_turns} ending in a loop), failed turns: "
            f"{t.failed_text()} ({t.skipped_turns} turns left out), conversations with nothing kept {t.dropped}",
            f"{t.new_tokens} tokens in {self.seconds:.1f} s: {self.tokens_per_s:.0f} generated tokens/s",
            *self._source_lines(),
        ]

    def _source_lines(self) -> list[str]:
        left_out = ", ".join(f"{n} {why}" for why, n in sorted(self.source_left_out.items()))
        lines = [f"source records left out: {left_out}"] if left_out else []
        return lines + [f"note: {note}" for note in self.notes]


def load_model(target_path: Path, device: str) -> Any:
    """The target as a plain HF causal LM on ``device`` (bf16 on CUDA, fp32 on CPU), SDPA attention."""
    from transformers import AutoModelForCausalLM

    from dflash_pipe.compute.precision import compute_dtype

    dtype = compute_dtype(device)
    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False).to(device)


def regenerate_file(
    target_path: Path,
    data: DataConfig,
    settings: RegenConfig,
    out: Path,
    *,
    device: str,
    progress: bool = True,
) -> RegenerateSummary:
    """Regenerates every conversation of ``data.path`` not yet in ``out`` (appending to it), with a rich
    progress bar. Raises ``DataError`` for bad input and ``RegenFileError`` when ``out`` was made with
    another target, source or settings."""
    from transformers import AutoTokenizer

    from dflash_pipe.target.generate import TurnGenerator

    source = load_conversations(data, spill_dir=Path(out).parent)
    store = RegenStore(out, provenance(target_path, data, settings))
    try:
        todo = [i for i in range(len(source.conversations)) if i not in store.done]
        summary = RegenerateSummary(
            out=Path(out),
            conversations=len(source.conversations),
            reused=len(store.done),
            source_left_out={**source.skip_reasons, **source.drop_reasons},
            notes=list(source.notes),
        )
        if not todo:
            return summary
        tokenizer = AutoTokenizer.from_pretrained(str(target_path))
        generator = TurnGenerator(
            load_model(target_path, device),
            tokenizer,
            settings,
            device=device,
            max_length=data.max_length,
            template_kwargs=data.chat_template_kwargs,
        )
        t0 = time.perf_counter()
        with _bar(len(todo), progress) as advance:

            def done(record: Regenerated) -> None:  # written as soon as its last turn is decoded
                store.append([record])
                summary.tally.add(record)
                summary.seconds = time.perf_counter() - t0
                advance(1, summary.tokens_per_s)

            # the plain path decodes a call's conversations as one padded batch: only batch_size of them
            chunk_size = generator.batch_size * (CHUNK_SLOTS if generator.engine() is not None else 1)
            try:
                for start in range(0, len(todo), chunk_size):
                    chunk = todo[start : start + chunk_size]
                    generator.regenerate([(i, source.conversations[i]) for i in chunk], on_done=done)
            except KeyboardInterrupt:  # each finished conversation is in the file already
                summary.interrupted = True
        return summary
    finally:
        store.close()


class _bar:
    """A rich progress bar of conversations with the generated tokens/s (nothing when not shown)."""

    def __init__(self, total: int, show: bool) -> None:
        self.total, self.show = total, show
        self._progress: Any = None

    def __enter__(self):
        if not self.show:
            return lambda n, rate: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("regenerating"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._progress.start()
        task = self._progress.add_task("regenerate", total=self.total, rate="")

        def advance(n: int, rate: float) -> None:
            self._progress.update(task, advance=n, rate=f"{rate:.0f} tok/s")

        return advance

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
