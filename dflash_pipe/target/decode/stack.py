"""The target's decoder run layer by layer over its own HF modules, against a static slot cache.

Why not the model's ``forward``: its per-call Python (mask builders, cache objects, kwargs plumbing, the
names that change between transformers releases) is exactly the host cost a decode step must not pay, and
it cannot be captured in a CUDA graph. The modules themselves (projections, norms, MLP, embedding, LM head)
are called as they are, so the weights and the arithmetic stay HF's; only attention and the cache are ours:
keys and values live in ``SlotCache`` (one row per slot, written at each token's position), and a query
attends to the positions of its own slot up to its own. ``tests/target/test_decode_engine.py`` checks the
result against HF's own ``generate``, token for token.

Families served here are dense full-attention decoders with rotary positions (Qwen3, Qwen2, Llama,
Mistral without a sliding window) and their MoE variants (Qwen3-MoE, Qwen2-MoE: the MLP block is called as
it is). ``unsupported_reason`` names why another model is not, and the caller falls back to HF's forward.

Why one file past 400 lines: decode steps, verify blocks and both prefill layouts are one class over one
cache layout, one set of layer functions and one compile policy; split, each half reads the other's state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_pipe.compute.compile import FLEX_MIN_HEAD_DIM
from dflash_pipe.target.decode import attention_kernel
from dflash_pipe.target.decode.fuse import fuse_layer
from dflash_pipe.target.decode.layer import (
    LayerMath,
    combine_out,
    compile_layer_fn,
    decode_out,
    extend_out,
    layer_in,
    packed_out,
    prefill_out,
)
from dflash_pipe.target.layers import find_decoder_layers
from dflash_pipe.target.packing import FLEX_PAD_TO, call_compiled, packed_block_mask

DENSE_FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
"""Families whose decode step is captured whole in a CUDA graph."""
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
"""Families served eagerly: HF's expert dispatch picks experts on the host (data-dependent shapes)."""
PREFILL_LAYOUTS = ("padded", "packed")
POSITION_ONLY_ROPE = ("default", "linear", "llama3", "yarn", None)
"""RoPE types whose cos/sin depend on the position alone (so one table serves every step)."""


@dataclass(frozen=True, slots=True)
class StackShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int

    @classmethod
    def of(cls, config: Any, layers: int) -> StackShape:
        """The attention shape of an HF (text) config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            layers=layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            hidden=config.hidden_size,
            vocab=config.vocab_size,
        )


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the slot engine cannot decode ``model`` exactly (None: it can)."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in DENSE_FAMILIES + MOE_FAMILIES:
        return f"model type {family!r} is not one of {', '.join(DENSE_FAMILIES + MOE_FAMILIES)}"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "it uses a sliding window"
    if family == "mistral" and getattr(config, "sliding_window", None):
        return "it uses a sliding window"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"its layer types are {sorted(types)}, not full attention only"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in POSITION_ONLY_ROPE:
        return f"its RoPE type {rope_type!r} depends on the sequence length"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"its layers are split across {len(devices)} devices"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "norm", "rotary_emb"):
        if not isinstance(getattr(inner, name, None), nn.Module):
            return f"it has no model.{name}"
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return "it has no lm_head"
    attn = find_decoder_layers(model)[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not isinstance(getattr(attn, name, None), nn.Linear):
            return f"its attention has no {name} projection"
    return None


def graph_safe(model: nn.Module) -> bool:
    """Whether a decode step over ``model`` can be captured in a CUDA graph (no host decisions inside)."""
    return getattr(model.config, "model_type", None) in DENSE_FAMILIES


class SlotCache:
    """Keys and values of every slot, ``[slots, kv_heads, max_len + 1, head_dim]`` per layer.

    Column ``max_len`` is a trash column: idle slots and padded prefill positions write there, and no
    query ever reads it (attention reads columns ``< max_len`` only)."""

    def __init__(self, shape: StackShape, slots: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.slots = slots
        self.max_len = max_len
        self.trash = max_len
        size = (slots, shape.kv_heads, max_len + 1, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class DecodeStack:
    """Prefill and one-token decode steps of an HF decoder against a ``SlotCache``."""

    def __init__(
        self,
        model: nn.Module,
        max_len: int,
        *,
        decode_attention: str | None = None,
        compile_layers: bool | None = None,
        compile_prefill: bool | None = None,
        prefill_layout: str | None = None,
    ) -> None:
        """``decode_attention``: "triton" (``attention_kernel``: each slot's live columns only, bf16/fp16 on
        CUDA), "sdpa" (``scaled_dot_product_attention`` with a boolean mask over the whole span) or "matmul"
        (two batched matmuls and a softmax, which repeat no keys: a third faster than SDPA on CPU, where SDPA
        copies them per head). None: triton where it is supported, else sdpa on CUDA, matmul elsewhere
        (timings: ``bench/engine_profile.py``). ``compile_layers``: decode steps run every layer through one ``torch.compile``'d function
        (Inductor fuses the norms, RoPE, residual adds and softmax: an eager step is ~800 kernels, a third of
        its time in elementwise ones); one graph serves all layers, so it compiles in seconds, not the
        minutes a whole-step graph took. Default: on CUDA for families ``graph_safe`` accepts.
        ``compile_prefill``: the same for prefill calls (default: as ``compile_layers``).
        ``prefill_layout``: how fresh prompts (nothing cached before them) are prefilled: "padded" (right-
        padded rows, SDPA causal) or "packed" (back to back in one row, flex attention through a block
        mask: no pad token computed; the producer's feature forward runs the same way). Uncompiled, flex
        materialises the whole score matrix: "packed" is meant for compiled prefill (CUDA). None: packed
        where prefill is compiled on CUDA and the head dim is one compiled flex takes, else padded (packed
        was 10% faster at the Qwen3-1.7B shape, batch 64, on the H200: ``docs/performance.md``)."""
        if prefill_layout is not None and prefill_layout not in PREFILL_LAYOUTS:
            raise ValueError(f"prefill_layout must be one of {PREFILL_LAYOUTS}, got {prefill_layout!r}")
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot be decoded by the slot engine: {reason}")
        self.model = model
        inner: Any = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.layers = list(find_decoder_layers(model))
        self.fused = [fuse_layer(layer) for layer in self.layers]
        attn = self.layers[0].self_attn
        self.shape = StackShape.of(model.config, len(self.layers))
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        positions = torch.arange(max_len + 1, device=self.device)[None]  # [1, L+1]; the last: trash column
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = inner.rotary_emb(probe, positions)  # HF's own cos/sin, per position
        self.cos, self.sin = cos[0], sin[0]  # [L+1, D]
        self.max_len = max_len
        head_dim = self.shape.head_dim
        triton_ok = attention_kernel.supported(self.dtype, head_dim, self.device)
        if decode_attention is None:
            decode_attention = "triton" if triton_ok else "sdpa" if self.device.type == "cuda" else "matmul"
        if decode_attention not in ("triton", "matmul", "sdpa"):
            raise ValueError(
                f"decode_attention must be 'triton', 'matmul' or 'sdpa', got {decode_attention!r}"
            )
        if decode_attention == "triton" and not triton_ok:
            raise ValueError(
                f"decode_attention='triton' needs bf16/fp16 on CUDA and a power-of-two head dim >= 16; this "
                f"model is {self.dtype} on {self.device} with head dim {head_dim}: use 'sdpa' or 'matmul'"
            )
        self.math = LayerMath(
            heads=self.shape.heads,
            kv_heads=self.shape.kv_heads,
            head_dim=self.shape.head_dim,
            scaling=float(getattr(attn, "scaling", self.shape.head_dim**-0.5)),
            qk_norm=hasattr(attn, "q_norm") and hasattr(attn, "k_norm"),
            decode_attention=decode_attention,
            gqa=self.shape.heads != self.shape.kv_heads,
        )
        self.graph_safe = graph_safe(model)
        """Whether ``step`` may be captured in a CUDA graph (MoE blocks pick experts on the host)."""
        if compile_layers is None:
            compile_layers = self.device.type == "cuda" and self.graph_safe
        self.compile_layers = compile_layers
        self.compile_prefill = compile_layers if compile_prefill is None else compile_prefill
        compiled_cuda = self.compile_prefill and self.device.type == "cuda"
        flex_ok = head_dim >= FLEX_MIN_HEAD_DIM
        if prefill_layout is None:
            prefill_layout = "packed" if compiled_cuda and flex_ok else "padded"
        if prefill_layout == "packed" and self.compile_prefill and not (compiled_cuda and flex_ok):
            raise ValueError(
                f"prefill_layout='packed' with compiled prefill needs CUDA and a head dim >= "
                f"{FLEX_MIN_HEAD_DIM} (compiled flex attention's smallest); this model is on {self.device} "
                f"with head dim {head_dim}: use compile_prefill=False or prefill_layout='padded'"
            )
        self.prefill_layout = prefill_layout

    @property
    def decode_attention(self) -> str:
        return self.math.decode_attention

    def new_cache(self, slots: int) -> SlotCache:
        return SlotCache(self.shape, slots, self.max_len, self.dtype, self.device)

    def _layer_fn(self, fn: Callable, compiled: bool, size: int) -> Callable:
        """``fn`` for this stack's layers: eager, or compiled (its first call per size class under the
        process-wide compile lock: target replicas are threads, and compiling is not thread-safe). Decode
        steps (``size`` 1) on the Triton kernel compile with static sizes: one graph per slot count (and
        per verify block size), whose kernels know their shapes. Prefill keeps dynamic sizes (its row
        counts and lengths vary), and so do the sdpa and matmul steps, whose span is an argument."""
        if not compiled:
            return functools.partial(fn, self.math)
        static = size == 1 and self.decode_attention == "triton"
        graph = compile_layer_fn(fn, self.math, not static)
        return functools.partial(call_compiled, graph, size, self.device)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # [B, T, 1, D]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()

    # --- decode: one token per slot ---------------------------------------------------------------------

    def step(
        self, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor, span: int
    ) -> torch.Tensor:
        """Feeds ``tokens`` ``[S]`` at ``positions`` ``[S]`` (the trash column for idle slots) and returns the
        next-token logits ``[S, V]`` (fp32). Every live position must be ``< span``: attention reads the
        first ``span`` columns of each slot. No host synchronisation: capturable in a CUDA graph."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        h, _ = self._decode(cache, rows, tokens, positions, span, (), gather=False)
        return self._logits(h)

    def block_step(
        self,
        cache: SlotCache,
        slots: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        span: int,
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step whose row ``r`` is token ``tokens[r]`` of cache row ``slots[r]`` at ``positions[r]``:
        a block of one slot's tokens at consecutive positions is verified in one step (every row's key is
        written before any row attends, so each attends to the block's tokens before it). Returns the logits
        after each row ``[R, V]`` (fp32) and the outputs of ``feature_layers`` concatenated ``[R, k*H]``.
        No host synchronisation: capturable in a CUDA graph."""
        h, captured = self._decode(cache, slots, tokens, positions, span, feature_layers, gather=True)
        return self._logits(h), torch.cat([captured[i] for i in feature_layers], dim=-1)

    def _decode(
        self,
        cache: SlotCache,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        span: int,
        feature_layers: Sequence[int],
        *,
        gather: bool,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One query per row (row ``r`` on cache row ``rows[r]``): the last layer's output ``[R, H]`` and the
        outputs of ``feature_layers``. ``gather``: rows are not the cache's rows in order, so the sdpa and
        matmul paths read each row's cache row (the Triton kernel reads ``rows`` itself)."""
        lengths = mask = None
        if self.decode_attention == "triton":
            lengths = torch.where(positions >= self.max_len, 1, positions + 1)  # idle slots: column 0 only
        else:
            visible = torch.arange(span, device=tokens.device)[None] <= positions[:, None]  # [S, span]
            mask = visible[:, None, None]  # [S, 1, 1, span]
            if self.decode_attention == "matmul":
                bias = torch.zeros(mask.shape, dtype=torch.float32, device=tokens.device)
                mask = bias.masked_fill(~mask, float("-inf"))
        cos, sin = self._rope(positions[:, None])
        first = self._layer_fn(layer_in, self.compile_layers, 1)
        then = self._layer_fn(decode_out, self.compile_layers, 1)
        merged = self._layer_fn(combine_out, self.compile_layers, 1)
        captured: dict[int, torch.Tensor] = {}
        h = self.embed(tokens)[:, None]  # [S, 1, H]
        for i, (layer, fused) in enumerate(zip(self.layers, self.fused, strict=True)):
            q, k, v = first(layer, fused, h, cos, sin)
            if mask is None and not gather:  # one row per cache row: the kernel writes k and v itself
                out, lse = attention_kernel.decode_attention(
                    q[:, 0],
                    cache.keys[i],
                    cache.values[i],
                    lengths,
                    span,
                    self.math.scaling,
                    rows,
                    write=(k[:, 0], v[:, 0], positions),
                )
                h = merged(layer, fused, h, out, lse)
                if i in feature_layers:
                    captured[i] = h[:, 0]
                continue
            # the cache is written between the compiled halves: a compiled graph that mutated its input
            # might copy the whole cache back
            cache.keys[i][rows, :, positions] = k[:, 0]
            cache.values[i][rows, :, positions] = v[:, 0]
            if mask is None:  # a verify block: its rows see each other's keys, written above
                out, lse = attention_kernel.decode_attention(
                    q[:, 0], cache.keys[i], cache.values[i], lengths, span, self.math.scaling, rows
                )
                h = merged(layer, fused, h, out, lse)
            elif gather:
                keys, values = cache.keys[i][rows, :, :span], cache.values[i][rows, :, :span]
                h = then(layer, fused, h, q, keys, values, mask, span)
            else:
                h = then(layer, fused, h, q, cache.keys[i], cache.values[i], mask, span)
            if i in feature_layers:
                captured[i] = h[:, 0]
        return h[:, 0], captured

    # --- prefill: new tokens of some slots, after what their cache already holds ------------------------

    def prefill(
        self, cache: SlotCache, slots: list[int], seqs: list[list[int]], starts: list[int]
    ) -> torch.Tensor:
        """Writes ``seqs[r]`` into slot ``slots[r]`` from position ``starts[r]`` on (the slot's cache keeps
        positions ``< starts[r]``) and returns the logits after each one's last token ``[k, V]`` (fp32)."""
        if self.prefill_layout == "packed" and not any(starts):
            return self._logits(self._packed(cache, slots, seqs))
        h, lengths, _ = self._rows(cache, slots, seqs, starts, ())
        last = h[torch.arange(len(seqs), device=self.device), lengths - 1]  # [k, H]
        return self._logits(last)

    def _packed(self, cache: SlotCache, slots: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """Fresh prompts back to back in one row: the last layer's output after each one's last token
        ``[k, H]``. The row is padded to whole flex tiles when compiled (fewer shape variants); the pad
        tokens are a sample of their own and write to the trash column."""
        dev = self.device
        lengths = [len(seq) for seq in seqs]
        total = sum(lengths)
        pad = -total % FLEX_PAD_TO if self.compile_prefill else 0
        ids = torch.as_tensor([t for seq in seqs for t in seq] + [0] * pad, dtype=torch.long)
        counts = torch.as_tensor(lengths + [pad])
        sample = torch.repeat_interleave(torch.arange(len(seqs) + 1), counts)  # [T]: the prompt of each token
        first_of = torch.cumsum(counts, 0) - counts  # where each prompt starts in the row
        where = torch.arange(total + pad) - first_of[sample]  # position in its own slot
        where[total:] = cache.trash
        slot_of = torch.as_tensor(slots + [slots[0]])[sample]
        ids, sample, where, slot_of = (t.to(dev) for t in (ids, sample, where, slot_of))
        mask = packed_block_mask(sample, compile=self.compile_prefill)
        cos, sin = self._rope(where[None])
        first = self._layer_fn(layer_in, self.compile_prefill, total + pad)
        attend = self._layer_fn(packed_out, self.compile_prefill, total + pad)
        h = self.embed(ids)[None]  # [1, T, H]
        for i, (layer, fused) in enumerate(zip(self.layers, self.fused, strict=True)):
            q, k, v = first(layer, fused, h, cos, sin)
            cache.keys[i][slot_of, :, where] = k[0]
            cache.values[i][slot_of, :, where] = v[0]
            h = attend(layer, fused, h, q, k, v, mask)
        last = torch.cumsum(torch.as_tensor(lengths, device=dev), 0) - 1
        return h[0, last]

    def extend(
        self, cache: SlotCache, slot: int, tokens: list[int], start: int, feature_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot's ``tokens`` written from ``start`` on (a prompt, or a block to verify: whatever the
        cache held past ``start`` is overwritten or never read again, so rolling back is choosing the next
        ``start``). Returns the logits after every token ``[n, V]`` (fp32) and the outputs of the decoder
        layers ``feature_layers`` concatenated ``[n, k*H]`` (HF's ``hidden_states[id + 1]``), or None."""
        h, _, captured = self._rows(cache, [slot], [tokens], [start], feature_layers)
        features = torch.cat([captured[i][0] for i in feature_layers], dim=-1) if feature_layers else None
        return self._logits(h[0]), features

    def _rows(
        self,
        cache: SlotCache,
        slots: list[int],
        seqs: list[list[int]],
        starts: list[int],
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder over right-padded rows; the last layer's output ``[k, n, H]``, the rows' lengths
        ``[k]`` and the outputs of ``feature_layers``."""
        real = len(seqs)
        n = max(len(s) for s in seqs)
        if self.compile_prefill:  # Dynamo gives sizes 1 graphs of their own: pad to 2 rows and 2 columns
            pad = max(0, 2 - real)
            slots, seqs, starts = slots + [slots[0]] * pad, seqs + [[]] * pad, starts + [0] * pad
            n = max(n, 2)
        k_rows = len(seqs)
        dev = self.device
        ids = torch.zeros((k_rows, n), dtype=torch.long)
        for r, seq in enumerate(seqs):
            ids[r, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        ids = ids.to(dev)
        lengths = torch.as_tensor([len(s) for s in seqs], device=dev)
        start = torch.as_tensor(starts, device=dev)
        offsets = torch.arange(n, device=dev)[None]
        positions = start[:, None] + offsets  # [k, n]
        valid = offsets < lengths[:, None]
        where = torch.where(valid, positions, cache.trash)  # padded tokens write to the trash column
        slot_idx = torch.as_tensor(slots, device=dev)[:, None]
        span = max(s + len(q) for s, q in zip(starts, seqs, strict=True))
        mask = None
        if any(starts):
            keys_at = torch.arange(span, device=dev)[None, None]  # [1, 1, span]
            mask = (keys_at <= positions[:, :, None])[:, None]  # [k, 1, n, span]
        cos, sin = self._rope(where)
        first = self._layer_fn(layer_in, self.compile_prefill, n)
        fresh = self._layer_fn(prefill_out, self.compile_prefill, n)
        cached = self._layer_fn(extend_out, self.compile_prefill, n)
        captured: dict[int, torch.Tensor] = {}
        h = self.embed(ids)  # [k, n, H]
        for i, (layer, fused) in enumerate(zip(self.layers, self.fused, strict=True)):
            q, k, v = first(layer, fused, h, cos, sin)
            cache.keys[i][slot_idx, :, where] = k
            cache.values[i][slot_idx, :, where] = v
            if mask is None:
                h = fresh(layer, fused, h, q, k, v)
            else:
                keys = cache.keys[i][slot_idx[:, 0], :, :span]  # [k, kvh, span, D]
                values = cache.values[i][slot_idx[:, 0], :, :span]
                h = cached(layer, fused, h, q, keys, values, mask)
            if i in feature_layers:
                captured[i] = h[:real]
        return h[:real], lengths[:real], captured
