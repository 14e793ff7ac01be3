"""Real acceptance inside a run: rank 0 decodes the held-out prompts by speculative decoding with the target.

The drafter workers hold only the target's embedding and LM head, so the first real evaluation loads the
whole target (plain HF, SDPA, KV cache) on rank 0's device and keeps it; the target's greedy decoding of each
prompt (the lossless reference and the speed baseline) is computed once and reused, since the target is
frozen. A prompt whose output differs from greedy decoding does not stop the run: it is counted in
``real/lossless_mismatches`` and said loudly in the worker log (and, by the producer, on the dashboard).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dflash_pipe.compute.precision import compute_dtype
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.drafter.generate_eval import (
    Reference,
    end_of_turn_ids,
    evaluate_generate,
    load_eval_target,
    prompts_from_samples,
)
from dflash_pipe.train.batches import DeviceBatch


class RealEval:
    """What the real evaluation keeps between evaluations of one worker: prompts, target, references."""

    def __init__(
        self,
        target_path: str | Path,
        eval_batches: Sequence[DeviceBatch],
        train: TrainConfig,
        device: torch.device,
    ) -> None:
        self.target_path = Path(target_path)
        self.train = train
        self.device = device
        rows = [
            SimpleNamespace(input_ids=b.input_ids[r].cpu(), loss_mask=b.loss_mask[r].cpu())
            for b in eval_batches
            for r in range(b.input_ids.shape[0])
        ]
        self.prompts = prompts_from_samples(rows, train.eval_prompts)
        self._target: nn.Module | None = None
        self._stop_ids: list[int] = []
        self._references: dict[int, Reference] = {}
        self.disabled: str | None = None
        """Why the real evaluation stopped for this worker (the target cannot load here, ...), or None."""

    def due(self, *, final: bool) -> bool:
        """Whether this evaluation (the final one, or a periodic one) runs the real decoding."""
        mode = self.train.eval_generate
        ready = bool(self.prompts) and self.disabled is None
        return ready and (mode == "every" or (mode == "end" and final))

    def run(self, drafter: nn.Module) -> dict[str, Any]:
        """The ``real/...`` metrics of ``drafter`` now (call with every other replica idle). A target that
        cannot load or run here (missing on this host, out of memory, a cache that cannot be cropped) turns
        the real evaluation off for this worker with one message; training goes on."""
        try:
            return self._run(drafter)
        except (
            OSError,
            ValueError,
            RuntimeError,
        ) as exc:  # OutOfMemoryError, CacheCropError are RuntimeErrors
            self.disabled = f"{type(exc).__name__}: {exc}"
            self._target = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            print(
                f"dflash-pipe worker: the real evaluation (train.eval_generate) is off from now on: it needs the "
                f"target {self.target_path} on {self.device} and failed: {self.disabled}. The simulated tau "
                "goes on; evaluate the exported drafter with `dflash-pipe eval --mode generate` instead.",
                file=sys.stderr,
                flush=True,
            )
            return {}

    def _run(self, drafter: nn.Module) -> dict[str, Any]:
        if self._target is None:
            from transformers import AutoTokenizer

            dtype = compute_dtype(self.device)
            self._target = load_eval_target(self.target_path, self.device, dtype)
            tokenizer = AutoTokenizer.from_pretrained(str(self.target_path))
            self._stop_ids = end_of_turn_ids(tokenizer, self.target_path)
        result = evaluate_generate(
            self._target,
            drafter,
            self.prompts,
            max_new_tokens=self.train.eval_max_new_tokens,
            stop_ids=self._stop_ids,
            check=True,
            strict=False,
            references=self._references,
        )
        if result.mismatches:
            print(
                f"dflash-pipe worker: REAL EVAL NOT LOSSLESS: {result.mismatches} of {len(result.prompts)} "
                "prompts decoded other tokens than the target's greedy decoding (see real/lossless_mismatches)",
                file=sys.stderr,
                flush=True,
            )
        return result.metrics()
