"""Decoding on the model's own forward, for the families the slot engine does not serve: every prompt of a
round together, left padded, with the model's own KV cache (hybrid and sliding-window targets get theirs).

Knows the model and tensors only: ``TurnGenerator`` (``target.generate``) builds the prompts and turns the
replies into conversations. The sampling (``pick``) is shared with the slot engine, so both paths draw
alike.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_pipe.data.config import RegenConfig
from dflash_pipe.target.decode import GenerationStopped
from dflash_pipe.target.packing import FLEX_ATTENTION

STOP_CHECK_EVERY = 8
"""Decode steps between checks whether every row has ended (each check waits for the device)."""
COMPACT_WHEN = 4
"""At a check, once 1/COMPACT_WHEN of the batch's rows have ended, they leave the batch (their cache rows
too: ``Cache.reorder_cache``), so a round's long replies do not drag the finished rows along."""


@dataclass(slots=True)
class Reply:
    """One decoded turn: its tokens without the end-of-turn token, and that token (None: the turn ran to its
    limit)."""

    tokens: list[int]
    end: int | None = None

    @property
    def ended(self) -> bool:
        return self.end is not None


class PlainDecoder:
    """Batched greedy or sampled decoding with the model's own forward and cache."""

    def __init__(
        self,
        model: nn.Module,
        settings: RegenConfig,
        *,
        device: torch.device,
        end_ids: list[int],
        pad_id: int,
    ) -> None:
        self.model, self.settings, self.device = model, settings, device
        self.end_ids, self.pad_id = end_ids, pad_id
        params = inspect.signature(model.forward).parameters
        self._keep_one = "logits_to_keep" in params
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new: Sequence[int],
        seeds: Sequence[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Reply]:
        """Decodes every prompt together (left padded, one KV cache) until each row has written an
        end-of-turn token or ``max_new[row]`` tokens; rows that have ended leave the batch as it goes
        (``COMPACT_WHEN``). ``seeds``: None decodes greedily, else one sampling seed per row (temperature /
        top-p / top-k of the settings)."""
        rows = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            mask[r, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # [B, S]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]
        limit = torch.as_tensor(list(max_new), dtype=torch.long, device=self.device)  # [B]
        end_ids = torch.as_tensor(self.end_ids, dtype=torch.long, device=self.device)
        generators = None
        if seeds is not None:
            generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        steps = int(limit.max())
        written = torch.zeros((rows, steps), dtype=torch.long, device=self.device)  # [B, N] by original row
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)  # [B]
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)  # [B] tokens written per row
        rows_now = torch.arange(rows, device=self.device)  # [b] the original row of each batch row
        with self._attention_for_decoding():
            out = self._forward(ids, mask, positions, None)
            cache, logits = self._cache_of(out), out.logits[:, -1]  # [B, V]
            next_pos = positions[:, -1] + 1  # [b]
            for step in range(steps):
                token = self.pick(logits, generators)  # [b]
                live = ~done[rows_now]  # [b]
                written[rows_now, step] = torch.where(live, token, self.pad_id)
                lengths[rows_now] += live.long()
                done[rows_now] |= live & (torch.isin(token, end_ids) | (lengths[rows_now] >= limit[rows_now]))
                if step + 1 == steps:
                    break
                if (step + 1) % STOP_CHECK_EVERY == 0:
                    finished = int(done[rows_now].sum())  # waits for the device
                    if finished == len(rows_now):
                        break
                    if finished * COMPACT_WHEN >= len(rows_now) and hasattr(cache, "reorder_cache"):
                        keep = (~done[rows_now]).nonzero().squeeze(1)  # [b'] rows still writing
                        cache.reorder_cache(keep)
                        mask, next_pos, token, rows_now = (
                            mask[keep],
                            next_pos[keep],
                            token[keep],
                            rows_now[keep],
                        )
                        if generators is not None:
                            generators = [generators[i] for i in keep.tolist()]
                if should_stop is not None and should_stop():
                    raise GenerationStopped
                ones = torch.ones((len(rows_now), 1), dtype=mask.dtype, device=self.device)
                mask = torch.cat([mask, ones], dim=1)
                out = self._forward(token[:, None], mask, next_pos[:, None], cache)
                cache, logits = self._cache_of(out), out.logits[:, -1]
                next_pos = next_pos + 1
        replies = []
        for row, n in zip(written.tolist(), lengths.tolist(), strict=True):
            tokens = row[:n]
            ended = bool(tokens) and tokens[-1] in self.end_ids
            replies.append(Reply(tokens[:-1], tokens[-1]) if ended else Reply(tokens))
        return replies

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._keep_one else {}
        kwargs[self._cache_arg] = cache
        return self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
        )

    def _cache_of(self, out: Any) -> Any:
        cache = out.get(self._cache_arg)
        if cache is None:
            raise RuntimeError(
                f"{type(self.model).__name__} returned no KV cache ({self._cache_arg}) with use_cache=True; "
                "regeneration needs a causal LM that caches its keys and values"
            )
        return cache

    def pick(self, logits: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
        """The next token per row: argmax, or a draw from the filtered distribution with the row's generator."""
        logits = logits.float()  # [B, V]
        if generators is None:
            return logits.argmax(dim=-1)
        probs = filtered_probs(logits, self.settings)  # [B, V]
        return torch.cat(
            [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
        )

    @contextlib.contextmanager
    def _attention_for_decoding(self) -> Iterator[None]:
        """The packed flex attention of feature batches needs a BlockMask; decoding with a cache runs SDPA."""
        config = getattr(self.model, "config", None)
        previous = getattr(config, "_attn_implementation", None)
        switch = previous == FLEX_ATTENTION and hasattr(self.model, "set_attn_implementation")
        if switch:
            self.model.set_attn_implementation("sdpa")
        try:
            yield
        finally:
            if switch:
                self.model.set_attn_implementation(previous)


def filtered_probs(logits: torch.Tensor, settings: RegenConfig) -> torch.Tensor:
    """Sampling probabilities ``[B, V]`` after temperature, top-k and top-p (the most likely token always
    stays)."""
    logits = logits / settings.temperature
    if settings.top_k and settings.top_k < logits.shape[-1]:
        kth = torch.topk(logits, settings.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if settings.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs = sorted_probs.masked_fill(before >= settings.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs
