"""The DFlash drafter: Qwen3-style layers with KV injection of the target's context features.

Attribute names are the reference checkpoint's key names (layers.{i}.self_attn.q_proj, fc, hidden_norm,
...), so `state_dict()` is the export format as is. The target's embedding and LM head are held outside
the module tree: frozen, never in `state_dict()` or `trainable_parameters()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_pipe.compute.compile import FLEX_MIN_HEAD_DIM, flex_kernel_options
from dflash_pipe.config.drafter import DrafterConfig
from dflash_pipe.config.rope import rope_inv_freq

from .checkpointing import CheckpointPolicy
from .loss import DEFAULT_CE_CHUNK, DrafterOutput, build_block_targets, drafter_loss
from .masks import (
    FLEX_BLOCK,
    anchor_pad_multiple,
    dense_mask,
    flex_block_mask,
    pad_anchors,
    sample_anchors,
    training_eligible,
)

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q [B,Hq,Q,D], k, v [B,Hkv,K,D]) -> [B,Hq,Q,D]


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_cos_sin(
    inv_freq: Tensor, positions: Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """positions [B, L] -> cos, sin [B, 1, L, D] (fp32 angles, times the RoPE attention factor, cast to
    dtype), the order of operations of transformers' rotary embedding."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context | block] through the same k_proj/v_proj."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_k: tuple[Tensor, Tensor],
        attend: Attend,
    ) -> Tensor:
        bsz, q_len, _ = x.shape  # x [B, Q, H], ctx [B, S, H]
        kv_in = torch.cat([ctx, x], dim=1)  # [B, S+Q, H]
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, kv_len, self.num_kv_heads, self.head_dim)).transpose(
            1, 2
        )
        v = self.v_proj(kv_in).view(bsz, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # fp32 norm weights promote q, k to fp32 (v keeps the autocast dtype); a compiled flex that does not
        # cast them back runs fp32 kernels (many times slower, not the tuned tiles): cast here, always.
        q = apply_rope(q, *rope_q).to(v.dtype)
        k = apply_rope(k, *rope_k).to(v.dtype)
        out = attend(q, k, v)  # [B, Hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q, rope_k, attend: Attend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def run_layer(layer: DFlashLayer, x: Tensor, ctx: Tensor, rope_q, rope_k, attend: Attend) -> Tensor:
    """One layer, eagerly: the default ``Kernels.layer``, and the function ``train.build`` compiles."""
    return layer(x, ctx, rope_q, rope_k, attend)


LayerRun = Callable[..., Tensor]  # (layer, x, ctx, rope_q, rope_k, attend) -> x, as ``run_layer``


@dataclass(frozen=True, slots=True)
class Kernels:
    """How the forward runs each part. ``train.build.apply_compile`` replaces the whole value (a fallback
    re-applies with less); nothing inside ``forward`` changes it. The default is what a drafter built
    for inference runs: eager layers and CE terms, the flex kernel compiled on CUDA (eager flex
    materialises every score) with the tuned tiles."""

    layer: LayerRun = run_layer
    """Runs one decoder layer: ``run_layer``, or ``train.build.CompiledLayers`` (the layers compiled)."""
    compile_attention: bool | None = None
    """torch.compile the flex block mask and kernel; None: on CUDA."""
    tuned_flex_tiles: bool = True
    """The compiled flex kernel gets ``compute.compile.flex_kernel_options``; False: Inductor's own."""
    fused_ce: bool = False
    """The LM head's softmax/CE terms compiled into one kernel (CUDA only)."""


@functools.cache
def _compiled_flex_attention() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def sdpa_attend(mask: Tensor) -> Attend:
    """SDPA with a dense boolean mask [B, 1, Q, K]; GQA by repeating K/V heads."""

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


def flex_attend(block_mask, *, compile: bool, tiles: dict[str, int] | None = None) -> Attend:
    """``tiles``: the compiled kernel's ``kernel_options``, chosen outside the compiled layers (a constant)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex_attention() if compile else flex_attention
    options = tiles if compile else None

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)

    return attend


class DFlashDrafter(nn.Module):
    """DFlash draft model. `forward` is the training objective; `block_hidden` is the shared core.

    Built eager; ``train.build`` then applies activation checkpointing (``checkpointing``) and compile
    (``kernels``) to it, as torchtitan's ``parallelize`` does. The forward only runs what was applied."""

    def __init__(
        self,
        cfg: DrafterConfig,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        *,
        ce_chunk: int = DEFAULT_CE_CHUNK,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        for part in (embed_tokens, lm_head):
            part.requires_grad_(False)
        # a tuple keeps the frozen target parts out of the module tree (state_dict, .parameters(), .to()).
        self._target_parts = (embed_tokens, lm_head)
        self._reference = False  # inside ``reference()``: eager, SDPA with the dense mask
        self.kernels = Kernels()  # train.build.apply_compile
        self.checkpointing = CheckpointPolicy()  # train.build.apply_checkpointing
        self.ce_chunk = ce_chunk
        # fp32 angles on purpose: a plain attribute, so model.to(bfloat16) cannot round it.
        self.inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.reset_parameters()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_parts[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._target_parts[1]

    def reset_parameters(self, std: float = 0.02) -> None:
        """Qwen3 init: normal(0, 0.02) linear weights, unit norms."""
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.parameters() if p.requires_grad)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Within: the same weights run eagerly, attention through SDPA with the dense mask (another kernel
        than flex's), with the same checkpointing. What the warm-up checks the compiled step against
        (``train.compile_check``)."""
        self._reference = True
        try:
            yield
        finally:
            self._reference = False

    def use_attention(self, backend: str) -> None:
        """Attend with ``backend`` ("auto", "flex", "sdpa") from now on. Speculative decoding drafts one
        block at the end of the context: through flex it pays the training path's padding (the anchor to a
        128-row tile, the context to a multiple of 128) and a BlockMask each step, through SDPA a small
        dense mask; the drafts are the same (``tests/drafter/test_backends.py``)."""
        self.cfg = dataclasses.replace(self.cfg, attention_backend=backend)  # the config checks the name

    def backend(self, device: torch.device) -> str:
        if self._reference:
            return "sdpa"
        if self.cfg.attention_backend != "auto":
            return self.cfg.attention_backend
        return "flex" if device.type == "cuda" and self.cfg.head_dim >= FLEX_MIN_HEAD_DIM else "sdpa"

    def _compiles_attention(self, device: torch.device) -> bool:
        if self._reference:
            return False
        compile = self.kernels.compile_attention
        return compile if compile is not None else device.type == "cuda"

    def block_hidden(self, input_ids: Tensor, features: Tensor, anchors: Tensor, valid: Tensor) -> Tensor:
        """Final-norm hidden states of every block slot: [B, N, bs, H].

        input_ids [B, S], features [B, S, k*H], anchors/valid [B, N]. Block b = [input_ids[anchor],
        MASK x (bs-1)] at positions anchor + [0..bs-1]; context keys sit at positions 0..S-1.
        """
        return self._final_norm(self._layers_out(input_ids, features, anchors, valid), anchors.shape[1])

    def _final_norm(self, x: Tensor, n: int) -> Tensor:
        """x [B, N_pad*bs, H] (last layer's output) -> [B, N, bs, H] after the final norm."""
        bsz, bs = x.shape[0], self.cfg.block_size
        return self.norm(x).view(bsz, -1, bs, x.shape[-1])[:, :n]

    def _layers_out(self, input_ids: Tensor, features: Tensor, anchors: Tensor, valid: Tensor) -> Tensor:
        """The last draft layer's output before the final norm: [B, N_pad*bs, H]."""
        cfg, bs = self.cfg, self.cfg.block_size
        bsz = anchors.shape[0]
        device = input_ids.device
        backend = self.backend(device)
        if backend == "flex":
            # pad S and N*bs to the 128-row tile: fewer distinct shapes, no partial tiles. Padded context
            # keys sit at positions >= S > every anchor, so the `<` rule never shows them.
            s_pad = -(-input_ids.shape[1] // FLEX_BLOCK) * FLEX_BLOCK - input_ids.shape[1]
            if s_pad:
                input_ids = F.pad(input_ids, (0, s_pad))
                features = F.pad(features, (0, 0, 0, s_pad))
            anchors, valid = pad_anchors(anchors, valid, anchor_pad_multiple(bs))
        seq_len, n_pad = input_ids.shape[1], anchors.shape[1]
        dtype = self.fc.weight.dtype
        offs = torch.arange(bs, device=device)
        block_ids = torch.full((bsz, n_pad, bs), cfg.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        x = self.embed_tokens(block_ids.view(bsz, n_pad * bs)).to(dtype)  # [B, Q, H]
        ctx = self.hidden_norm(self.fc(features.to(dtype)))  # [B, S, H], shared by all layers
        q_pos = (anchors[:, :, None] + offs).view(bsz, n_pad * bs)  # [B, Q]
        k_pos = torch.cat([torch.arange(seq_len, device=device).expand(bsz, -1), q_pos], dim=1)  # [B, S+Q]
        rope_q = rope_cos_sin(self.inv_freq, q_pos, dtype, self.rope_scale)
        rope_k = rope_cos_sin(self.inv_freq, k_pos, dtype, self.rope_scale)
        attends = self._attends(backend, anchors, valid, seq_len, device)
        run = run_layer if self._reference else self.kernels.layer
        for layer, window in zip(self.layers, cfg.layer_windows, strict=True):
            x = self.checkpointing.run_layer(run, layer, x, ctx, rope_q, rope_k, attends[window])
        return x

    def _attends(
        self, backend: str, anchors: Tensor, valid: Tensor, seq_len: int, device: torch.device
    ) -> dict[int | None, Attend]:
        """One attention function per distinct layer pattern (window None = full_attention, W = a
        sliding_attention layer): the one place a layer's mask is decided, for training and inference."""
        bs, out = self.cfg.block_size, {}
        for window in dict.fromkeys(self.cfg.layer_windows):
            if backend == "flex":
                compile = self._compiles_attention(device)
                mask = flex_block_mask(anchors, valid, seq_len, bs, compile=compile, window=window)
                tuned = self.kernels.tuned_flex_tiles
                tiles = flex_kernel_options(self.cfg.head_dim, device) if tuned else None
                out[window] = flex_attend(mask, compile=compile, tiles=tiles)
            else:
                out[window] = sdpa_attend(dense_mask(anchors, valid, seq_len, bs, window))
        return out

    def forward(
        self,
        input_ids: Tensor,
        features: Tensor,
        loss_mask: Tensor,
        *,
        generator: torch.Generator | None = None,
    ) -> DrafterOutput:
        """input_ids [B, S] int64, features [B, S, k*H], loss_mask [B, S] bool (False on padding)."""
        cfg = self.cfg
        anchors, valid = sample_anchors(training_eligible(loss_mask), cfg.max_anchors, generator=generator)
        targets = build_block_targets(
            input_ids,
            loss_mask,
            anchors,
            valid,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            gamma=cfg.gamma,
        )
        x = self._layers_out(input_ids, features, anchors, valid)  # [B, N_pad*bs, H]
        n, num_anchors = anchors.shape[1], int(valid.sum().item())

        def head_loss(x: Tensor) -> tuple[Tensor, ...]:
            hidden = self._final_norm(x, n)  # [B, N, bs, H]
            out = drafter_loss(
                hidden,
                targets,
                self.lm_head.weight,
                chunk=self.ce_chunk,
                num_anchors=num_anchors,
                fused=self.kernels.fused_ce and hidden.is_cuda and not self._reference,
            )
            return out.loss_sum, out.weight_sum, out.slot_correct, out.slot_total

        loss_sum, weight_sum, slot_correct, slot_total = self.checkpointing.run_loss(head_loss, x)
        return DrafterOutput(
            loss_sum=loss_sum,
            weight_sum=weight_sum.detach(),
            slot_correct=slot_correct.detach(),
            slot_total=slot_total.detach(),
            num_anchors=num_anchors,
        )
