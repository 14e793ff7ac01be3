"""The slot engine's decoder for hybrid targets: Qwen3.5 / Qwen3.6 (dense and MoE), layer by layer.

(Over 400 lines: the two mixer layouts, the gated attention and the state freeze of idle slots belong
together; split, each half would need the other to be read.)

These targets interleave gated full-attention layers with Gated DeltaNet layers. A full-attention layer keeps
keys and values per slot exactly as ``SlotCache`` does (trash column included). A DeltaNet layer keeps, per
slot, a recurrent state ``[v_heads, k_dim, v_dim]`` (fp32, as HF keeps it) and the conv window's last
``kernel - 1`` inputs: the whole past of the slot folded into two fixed-size tensors. That fold cannot be
undone, so a slot can only go on from the end of what it holds (``rollback = False``): the engine reuses a
slot's state only when the next prompt extends all of it, and otherwise prefills from position 0.

As in ``stack.py`` only the modules are HF's (projections, norms, gated RMSNorm, MLP or MoE block, embedding,
LM head); the sequence arithmetic is HF's too, reimplemented on the slot cache: the one-token recurrent gated
delta rule of ``torch_recurrent_gated_delta_rule`` and the conv window of ``causal_conv1d_update`` in
``step`` (tensor ops only, no host sync), and HF's own chunked delta rule in ``prefill``.
``tests/target/test_decode_hybrid.py`` checks greedy decoding against HF's ``generate``, token for token.

Text only: image and video inputs (the vision tower, 3D mrope positions) stay HF's; on text positions the
three mrope sections are equal, so one cos/sin table per position serves. ``hybrid_unsupported_reason`` names
what else is not served (other RoPE types or layer types, unknown mixer layouts, split devices). Where fla
is installed on CUDA, HF's own decode runs fla's fused kernels instead of its torch path: the two agree to
rounding there, not bitwise.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipe.target.decode.layer import rotate_half
from dflash_pipe.target.decode.stack import StackShape
from dflash_pipe.target.gated_deltanet import _COMMON_PARAMS, _LAYOUT_PARAMS
from dflash_pipe.target.layers import find_decoder_layers
from dflash_pipe.target.packing import call_compiled

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
"""Model types served (the multimodal ones on text-only prompts: no image or video inputs). Qwen3-Next has
the same layers; its mixer's projection layout (``in_proj_qkvz``/``in_proj_ba``) is also qwen3_5's in older
transformers releases (5.17), so serving it keeps that layout tested."""
LINEAR, FULL = "linear_attention", "full_attention"
_MIXER_DIMS = ("num_k_heads", "num_v_heads", "conv_dim", "conv_kernel_size")


def _text_model(model: nn.Module) -> Any:
    """The text decoder: ``model.model`` (``...ForCausalLM``) or ``model.model.language_model`` (Hub
    checkpoints, ``...ForConditionalGeneration``)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", inner)


def _layout(mixer: nn.Module) -> str | None:
    """Which projection layout a DeltaNet mixer has (transformers 5.17's qwen3_5 has Qwen3-Next's)."""
    if all(hasattr(mixer, n) for n in _LAYOUT_PARAMS["qwen3_5"]):
        return "qwen3_5"
    if all(hasattr(mixer, n) for n in _LAYOUT_PARAMS["qwen3_next"]) and hasattr(
        mixer, "fix_query_key_value_ordering"
    ):
        return "qwen3_next"
    return None


def hybrid_unsupported_reason(model: nn.Module) -> str | None:
    """Why ``HybridStack`` cannot decode ``model`` exactly (None: it can)."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in HYBRID_FAMILIES:
        return f"model type {family!r} is not one of {', '.join(HYBRID_FAMILIES)}"
    text = config.get_text_config()
    types = list(getattr(text, "layer_types", None) or [])
    if set(types) - {LINEAR, FULL}:
        return f"its layer types {sorted(set(types))} are not only {LINEAR} and {FULL}"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":  # mrope sections: equal on text-only positions
        return f"its RoPE type {rope.get('rope_type')!r} is not 'default'"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"its layers are split across {len(devices)} devices"
    inner = _text_model(model)
    for name in ("embed_tokens", "norm", "rotary_emb"):
        if not isinstance(getattr(inner, name, None), nn.Module):
            return f"its text model has no {name}"
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return "it has no lm_head"
    layers = find_decoder_layers(model)
    if len(layers) != len(types):
        return f"it has {len(layers)} decoder layers but {len(types)} layer types"
    for i, (layer, kind) in enumerate(zip(layers, types, strict=True)):
        if kind == LINEAR:
            mixer = getattr(layer, "linear_attn", None)
            if mixer is None or _layout(mixer) is None:
                return f"linear-attention layer {i} has no Gated DeltaNet mixer of a known layout"
            missing = [n for n in (*_COMMON_PARAMS, *_MIXER_DIMS) if not hasattr(mixer, n)]
            if missing:
                return f"the mixer of layer {i} has no {missing}"
            if getattr(mixer, "activation", None) not in ("silu", "swish"):
                return f"the conv activation of layer {i} is {getattr(mixer, 'activation', None)!r}, not silu"
            if mixer.num_v_heads % mixer.num_k_heads:
                return f"layer {i} has {mixer.num_v_heads} value heads for {mixer.num_k_heads} key heads"
        else:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not all(hasattr(attn, n) for n in ("q_norm", "k_norm")):
                return f"full-attention layer {i} has no q_norm / k_norm"
            if not all(isinstance(getattr(attn, f"{n}_proj", None), nn.Linear) for n in "qkvo"):
                return f"full-attention layer {i} lacks a q/k/v/o projection"
            head_dim = getattr(attn, "head_dim", None) or text.hidden_size // text.num_attention_heads
            if attn.q_proj.out_features != 2 * text.num_attention_heads * head_dim:
                return f"the attention of layer {i} has no output gate in q_proj"
    return None


def _chunk_rule(mixer: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """HF's chunked gated delta rule, as the mixer's own modeling module binds it (fla's kernel where HF
    picked it, the torch one otherwise)."""
    rule = getattr(sys.modules.get(type(mixer).__module__), "torch_chunk_gated_delta_rule", None)
    if rule is None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as rule
    return rule


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # HF's l2norm (fla's eps)


def delta_rule_math(state, q, k, v, beta, g, live) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrent gated delta rule (HF's ``torch_recurrent_gated_delta_rule``) per slot:
    ``state`` ``[S, Hv, K, V]`` (fp32) -> the state to keep (advanced where ``live`` ``[S]``, as it was
    elsewhere) and the output ``[S, Hv, V]``. Six passes over the state eager; compiled (on CUDA), Inductor
    fuses them."""
    new = state * g.exp()[..., None, None]  # [S, Hv, K, V]
    delta = (v - (new * k[..., None]).sum(dim=-2)) * beta[..., None]  # [S, Hv, V]
    new = new + k[..., None] * delta[..., None, :]
    core = (new * q[..., None]).sum(dim=-2)
    return torch.where(live[:, None, None, None], new, state), core


@functools.cache
def _compiled_delta_rule() -> Callable:
    return torch.compile(delta_rule_math, dynamic=True)


class HybridCache:
    """Per slot: keys/values of the full-attention layers ``[slots, kv_heads, max_len + 1, head_dim]`` (column
    ``max_len``: trash, as in ``SlotCache``), and for DeltaNet layers a recurrent state ``[slots, v_heads,
    k_dim, v_dim]`` (fp32) and a conv window ``[slots, conv_dim, kernel - 1]``; ``None`` where a layer has
    not that kind. ``length`` ``[slots]``: how many tokens each slot's state holds (continuations start
    there)."""

    def __init__(self, stack: HybridStack, slots: int) -> None:
        self.slots, self.max_len, self.trash = slots, stack.max_len, stack.max_len
        dev, dt, s = stack.device, stack.dtype, stack.shape
        kv = (slots, s.kv_heads, stack.max_len + 1, s.head_dim)
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.recurrent: list[torch.Tensor | None] = []
        self.conv: list[torch.Tensor | None] = []
        for kind, layer in zip(stack.types, stack.layers, strict=True):
            full, m = kind == FULL, getattr(layer, "linear_attn", None)
            self.keys.append(torch.zeros(kv, dtype=dt, device=dev) if full else None)
            self.values.append(torch.zeros(kv, dtype=dt, device=dev) if full else None)
            shape = None if full else (slots, m.num_v_heads, m.head_k_dim, m.head_v_dim)
            self.recurrent.append(None if full else torch.zeros(shape, dtype=torch.float32, device=dev))
            window = None if full else (slots, m.conv_dim, m.conv_kernel_size - 1)
            self.conv.append(None if full else torch.zeros(window, dtype=dt, device=dev))
        self.length = torch.zeros(slots, dtype=torch.long, device=dev)

    @property
    def nbytes(self) -> int:
        tensors = self.keys + self.values + self.recurrent + self.conv
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _advanced(self) -> list[torch.Tensor]:
        return [t for t in self.recurrent + self.conv + [self.length] if t is not None]

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of what a step advances for good (recurrent and conv states, lengths; keys and values are
        rewritten by the next step at the same position): a warm-up step run before a CUDA graph capture
        must be undone with ``restore``, or every live slot would have seen its token twice."""
        return [t.clone() for t in self._advanced()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, kept in zip(self._advanced(), saved, strict=True):
            t.copy_(kept)


class HybridStack:
    """Prefill and one-token decode steps of a Qwen3.5-family target against a ``HybridCache``."""

    rollback = False
    """A slot's recurrent state holds all of its tokens or none: it cannot be cut back to a position."""

    def __init__(self, model: nn.Module, max_len: int) -> None:
        reason = hybrid_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot be decoded by the hybrid stack: {reason}")
        self.model = model
        inner = _text_model(model)
        self.embed, self.norm, self.lm_head = inner.embed_tokens, inner.norm, model.lm_head
        self.layers = list(find_decoder_layers(model))
        text = model.config.get_text_config()
        self.types: list[str] = list(text.layer_types)
        self.shape = StackShape.of(text, len(self.layers))
        self.scaling = self.shape.head_dim**-0.5
        self.device, self.dtype = self.embed.weight.device, self.embed.weight.dtype
        self.max_len = max_len
        positions = torch.arange(max_len + 1, device=self.device)[None]  # [1, L+1]; the last: trash column
        if hasattr(inner.rotary_emb, "mrope_section"):  # multimodal RoPE: one position row per grid axis
            positions = positions[None].expand(3, 1, -1)  # [3, 1, L+1]; some releases take only this form
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = inner.rotary_emb(probe, positions)  # HF's own table: 3 equal mrope sections on text
        self.cos, self.sin = cos[0], sin[0]  # [L+1, rotary_dim] (partial rotary: rotary_dim < head_dim)
        mixers = {i: layer.linear_attn for i, layer in enumerate(self.layers) if self.types[i] == LINEAR}
        self.layouts = {i: _layout(m) for i, m in mixers.items()}
        self.chunk_rules = {i: _chunk_rule(m) for i, m in mixers.items()}
        self.graph_safe = all(type(layer.mlp).__name__.endswith("MLP") for layer in self.layers)
        """Whether ``step`` may be captured in a CUDA graph (MoE blocks pick experts on the host)."""
        self._delta_rule: Callable = delta_rule_math
        if self.device.type == "cuda":  # one compiled function for every DeltaNet layer, first call locked
            self._delta_rule = functools.partial(call_compiled, _compiled_delta_rule(), 1, self.device)

    def new_cache(self, slots: int) -> HybridCache:
        return HybridCache(self, slots)

    # --- shared pieces ----------------------------------------------------------------------------------

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()

    def _mlp(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        out = layer.mlp(layer.post_attention_layernorm(h))
        return h + (out[0] if isinstance(out, tuple) else out)  # some MoE blocks return (hidden, logits)

    def _qkv(self, attn: nn.Module, x: torch.Tensor, positions: torch.Tensor):
        """Gated attention's q ``[B, T, heads, D]``, k, v ``[B, T, kv_heads, D]`` (rotated at ``positions``
        ``[B, T]``, partially) and output gate ``[B, T, heads * D]``."""
        b, t, _ = x.shape
        d = self.shape.head_dim
        query, gate = torch.chunk(attn.q_proj(x).view(b, t, -1, 2 * d), 2, dim=-1)
        q = attn.q_norm(query)
        k = attn.k_norm(attn.k_proj(x).view(b, t, -1, d))
        v = attn.v_proj(x).view(b, t, -1, d)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # [B, T, 1, R]
        r = cos.shape[-1]
        q = torch.cat([q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1)
        k = torch.cat([k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1)
        return q, k, v, gate.reshape(b, t, -1)

    def _gated_out(self, attn: nn.Module, attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``attended`` ``[B, heads, T, D]`` -> the layer's mixer output ``[B, T, H]``."""
        b, _, t, _ = attended.shape
        return attn.o_proj(attended.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate))

    def _project(self, i: int, mixer: nn.Module, x: torch.Tensor):
        """DeltaNet inputs of ``x`` ``[B, T, H]``: conv input ``[B, T, conv_dim]`` (q|k|v), z ``[B, T, Hv, V]``,
        b and a ``[B, T, Hv]``, as ``packed_gated_deltanet`` splits both layouts."""
        b, t, _ = x.shape
        if self.layouts[i] == "qwen3_5":
            mixed = mixer.in_proj_qkv(x)
            z = mixer.in_proj_z(x).reshape(b, t, -1, mixer.head_v_dim)
            return mixed, z, mixer.in_proj_b(x), mixer.in_proj_a(x)
        q, k, v, z, beta_in, a = mixer.fix_query_key_value_ordering(
            mixer.in_proj_qkvz(x), mixer.in_proj_ba(x)
        )
        return torch.cat([u.reshape(b, t, -1) for u in (q, k, v)], dim=-1), z, beta_in, a

    def _conv(self, mixer: nn.Module, window: torch.Tensor, t: int) -> torch.Tensor:
        """silu of the depthwise causal conv over ``window`` ``[B, conv_dim, kernel - 1 + t]`` -> ``[B, t, conv_dim]``
        (HF's ``causal_conv1d_update`` arithmetic: no padding, the window holds the left context)."""
        weight = mixer.conv1d.weight  # [D, 1, W]
        out = F.conv1d(window.to(weight.dtype), weight, mixer.conv1d.bias, groups=window.shape[1])
        return F.silu(out[:, :, -t:]).to(window.dtype).transpose(1, 2)

    def _heads(self, mixer: nn.Module, qkv: torch.Tensor, b_in: torch.Tensor, a: torch.Tensor):
        """q, k ``[B, T, Hk, K]``, v ``[B, T, Hv, V]``, beta and the fp32 log-decay g ``[B, T, Hv]``."""
        b, t, _ = qkv.shape
        kd = mixer.key_dim
        q, k, v = torch.split(qkv, [kd, kd, qkv.shape[-1] - 2 * kd], dim=-1)
        q, k = q.reshape(b, t, -1, mixer.head_k_dim), k.reshape(b, t, -1, mixer.head_k_dim)
        v = v.reshape(b, t, -1, mixer.head_v_dim)
        g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
        return q, k, v, b_in.sigmoid(), g

    def _mix_out(self, mixer: nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        b, t = z.shape[:2]
        out = mixer.norm(core.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
        return mixer.out_proj(out.reshape(b, t, -1))

    # --- decode: one token per slot ---------------------------------------------------------------------

    def step(
        self, cache: HybridCache, tokens: torch.Tensor, positions: torch.Tensor, span: int
    ) -> torch.Tensor:
        """Feeds ``tokens`` ``[S]`` at ``positions`` ``[S]`` (the trash column for idle slots) and returns the
        next-token logits ``[S, V]`` (fp32). Live positions must be ``< span``. No host synchronisation.

        Idle slots are computed like the others but write nothing they keep: keys and values go to the trash
        column and their recurrent state, conv window and length stay as they were (``torch.where``). That
        matters: a slot whose turn ended holds the conversation's state, and the next turn's prefill goes on
        from it while the other slots still step."""
        s = tokens.shape[0]
        rows = torch.arange(s, device=tokens.device)
        live = positions != cache.trash  # [S]
        visible = torch.arange(span, device=tokens.device)[None] <= positions[:, None]  # [S, span]
        mask = visible[:, None, None]  # [S, 1, 1, span]
        h = self.embed(tokens)[:, None]  # [S, 1, H]
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            if self.types[i] == FULL:
                attn = layer.self_attn
                q, k, v, gate = self._qkv(attn, x, positions[:, None])
                keys, values = cache.keys[i], cache.values[i]
                keys[rows, :, positions] = k[:, 0]
                values[rows, :, positions] = v[:, 0]
                attended = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    keys[:, :, :span],
                    values[:, :, :span],
                    attn_mask=mask,
                    scale=self.scaling,
                    enable_gqa=True,
                )  # [S, heads, 1, D]
                h = h + self._gated_out(attn, attended, gate)
            else:
                h = h + self._linear_step(i, layer.linear_attn, x, cache, live)
            h = self._mlp(layer, h)
        cache.length.copy_(torch.where(live, positions + 1, cache.length))
        return self._logits(h[:, 0])

    def _linear_step(
        self, i: int, mixer: nn.Module, x: torch.Tensor, cache: HybridCache, live: torch.Tensor
    ) -> torch.Tensor:
        """One token per slot through a DeltaNet layer: ``x`` ``[S, 1, H]`` -> ``[S, 1, H]``."""
        conv_state, state = cache.conv[i], cache.recurrent[i]
        mixed, z, b_in, a = self._project(i, mixer, x)
        window = torch.cat([conv_state, mixed.transpose(1, 2)], dim=-1)  # [S, D, W]
        qkv = self._conv(mixer, window, 1)
        conv_state.copy_(torch.where(live[:, None, None], window[:, :, 1:], conv_state))
        q, k, v, beta, g = self._heads(mixer, qkv, b_in, a)
        groups = mixer.num_v_heads // mixer.num_k_heads
        q = _l2norm(q[:, 0].repeat_interleave(groups, dim=1).float())  # [S, Hv, K]
        k = _l2norm(k[:, 0].repeat_interleave(groups, dim=1).float())
        q = q / (q.shape[-1] ** 0.5)
        v, beta, g = v[:, 0].float(), beta[:, 0].float(), g[:, 0]  # [S, Hv, V], [S, Hv], [S, Hv]
        kept, core = self._delta_rule(state, q, k, v, beta, g, live)
        state.copy_(kept)  # outside the compiled graph: it mutates no input
        core = core.to(x.dtype)[:, None]  # [S, 1, Hv, V]
        return self._mix_out(mixer, core, z)

    # --- prefill: each row alone, from position 0 or from the end of what its slot holds ----------------

    def prefill(
        self, cache: HybridCache, slots: list[int], seqs: list[list[int]], starts: list[int]
    ) -> torch.Tensor:
        """Writes ``seqs[r]`` into slot ``slots[r]`` from position ``starts[r]`` on and returns the logits after
        each row's last token ``[k, V]`` (fp32). ``starts[r]`` is 0 (the slot starts over: its states are
        reset) or exactly the number of tokens the slot holds (its states go on); anything else is an error,
        since a recurrent state cannot be cut back."""
        held = cache.length[torch.as_tensor(slots, device=self.device)].tolist()
        for slot, seq, start, have in zip(slots, seqs, starts, held, strict=True):
            if start not in (0, have):
                raise ValueError(
                    f"slot {slot} holds {have} tokens; its prefill must start at 0 or {have}, not {start} "
                    "(a recurrent state cannot be rolled back)"
                )
            if not seq or start + len(seq) > self.max_len:
                raise ValueError(f"slot {slot}: {len(seq)} tokens from {start} do not fit {self.max_len}")
        out = [
            self._row(cache, slot, seq, start) for slot, seq, start in zip(slots, seqs, starts, strict=True)
        ]
        return torch.cat(out, dim=0)

    def _row(self, cache: HybridCache, slot: int, seq: list[int], start: int) -> torch.Tensor:
        """One slot's new tokens through every layer (batch 1): the logits after the last one ``[1, V]``."""
        n, dev = len(seq), self.device
        ids = torch.as_tensor(seq, dtype=torch.long, device=dev)[None]  # [1, n]
        positions = start + torch.arange(n, device=dev)[None]  # [1, n]
        fresh = start == 0
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            if self.types[i] == FULL:
                attn = layer.self_attn
                q, k, v, gate = self._qkv(attn, x, positions)
                cache.keys[i][slot, :, start : start + n] = k[0].transpose(0, 1)
                cache.values[i][slot, :, start : start + n] = v[0].transpose(0, 1)
                if fresh:
                    keys, values, mask = k.transpose(1, 2), v.transpose(1, 2), None
                else:
                    keys = cache.keys[i][slot : slot + 1, :, : start + n]
                    values = cache.values[i][slot : slot + 1, :, : start + n]
                    mask = torch.arange(start + n, device=dev)[None] <= positions[0][:, None]  # [n, start+n]
                groups = self.shape.heads // self.shape.kv_heads
                attended = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    keys.repeat_interleave(groups, dim=1),
                    values.repeat_interleave(groups, dim=1),
                    attn_mask=mask,
                    is_causal=fresh,
                    scale=self.scaling,
                )  # [1, heads, n, D]
                h = h + self._gated_out(attn, attended, gate)
            else:
                h = h + self._linear_row(i, layer.linear_attn, x, cache, slot, fresh)
            h = self._mlp(layer, h)
        cache.length[slot] = start + n
        return self._logits(h[:, -1])

    def _linear_row(
        self, i: int, mixer: nn.Module, x: torch.Tensor, cache: HybridCache, slot: int, fresh: bool
    ) -> torch.Tensor:
        """A row through a DeltaNet layer with HF's chunked delta rule, from the slot's stored states (zero
        when ``fresh``), storing the final ones: ``x`` ``[1, n, H]`` -> ``[1, n, H]``."""
        n = x.shape[1]
        conv_state, state = cache.conv[i], cache.recurrent[i]
        if fresh:
            conv_state[slot].zero_()
        mixed, z, b_in, a = self._project(i, mixer, x)
        window = torch.cat([conv_state[slot : slot + 1], mixed.transpose(1, 2)], dim=-1)  # [1, D, W-1+n]
        qkv = self._conv(mixer, window, n)
        conv_state[slot] = window[0, :, window.shape[-1] - conv_state.shape[-1] :]
        q, k, v, beta, g = self._heads(mixer, qkv, b_in, a)
        core, final = self.chunk_rules[i](
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=None if fresh else state[slot : slot + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        state[slot] = final[0]
        return self._mix_out(mixer, core, z)

    def extend(
        self, cache: HybridCache, slot: int, tokens: list[int], start: int, feature_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError(
            "HybridStack.extend: verifying a speculative block means rolling the cache back past rejected "
            "tokens, and a Gated DeltaNet recurrent state cannot be rolled back (rollback = False); use "
            "prefill/step, or HF's forward for speculative decoding of hybrid targets"
        )
