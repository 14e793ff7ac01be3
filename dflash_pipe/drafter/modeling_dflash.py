"""DFlash drafter for ``AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True)``, with greedy
speculative decoding against a Hugging Face target (``spec_generate``).

This file is written into every ``dflash-pipe export`` and runs from there: transformers executes it from
the export directory, where the dflash-pipe package need not be installed. It imports only torch and
transformers. Its class name (``DFlashDraftModel``, config class ``Qwen3Config``), its weight names and its
``spec_generate(target, input_ids, max_new_tokens, stop_token_ids, ...)`` entry point are those of the DFlash
reference, so the reference's README lines work on an export as they do on a published drafter:

    draft = AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True, dtype="auto").eval()
    output_ids = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256,
                                     stop_token_ids=[tokenizer.eos_token_id])

The forward is the one dflash-pipe trained (``dflash_pipe/drafter/model.py``): one block
``[last token, MASK x (bs-1)]`` after the context, queries from the block, keys and values from
[context features through fc + hidden_norm | block], the same RMSNorm, RoPE and attention masks per layer
type (a full-attention layer sees the whole context and its block both ways; a sliding layer a window, and
its block causally). ``tests/drafter/test_export_remote_code.py`` checks it against dflash-pipe's drafter.

Greedy only (``temperature=0``), batch 1, the drafter's context keys recomputed each step (no draft KV
cache): every output token is the target's own greedy choice, whatever the drafter proposes.
"""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, Qwen3Config

SLIDING_ATTENTION = "sliding_attention"


class DFlashRMSNorm(nn.Module):
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


def _dflash_value(config, name: str, default=None):
    """``dflash_config[name]``, else the top-level key (older exports), else ``default``."""
    dflash = getattr(config, "dflash_config", None) or {}
    return dflash.get(name, getattr(config, name, default))


def rope_inv_freq(config) -> tuple[Tensor, float]:
    """([head_dim/2] fp32 inverse frequencies, attention factor), as transformers' Qwen3 rotary embedding."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    dim = config.head_dim
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float().cpu(), float(factor)


def rope_cos_sin(
    inv_freq: Tensor, positions: Tensor, dtype: torch.dtype, scale: float
) -> tuple[Tensor, Tensor]:
    """positions [B, L] -> cos, sin [B, 1, L, D]: fp32 angles, times the attention factor, cast to dtype."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def block_mask(position_ids: Tensor, ctx_len: int, window: int | None) -> Tensor:
    """[B, 1, Q, S+Q] bool (True = attend) for one block after ``ctx_len`` context keys; ``position_ids``
    [B, S+Q]. Context keys before the block's first position are seen (a sliding layer: those within the
    window, the query included); the block's keys all (a sliding layer: its earlier slots in the window)."""
    ctx_pos, q_pos = position_ids[:, :ctx_len], position_ids[:, ctx_len:]  # [B, S], [B, Q]
    anchor = q_pos[:, :1]
    ctx = (ctx_pos[:, None, :] < anchor[:, :, None]).expand(-1, q_pos.shape[1], -1)  # [B, Q, S]
    q_len = q_pos.shape[1]
    own = torch.ones(q_len, q_len, dtype=torch.bool, device=position_ids.device)
    if window is not None:
        ctx = ctx & (q_pos[:, :, None] - ctx_pos[:, None, :] < window)
        offs = torch.arange(q_len, device=position_ids.device)
        lag = offs[:, None] - offs[None, :]
        own = (lag >= 0) & (lag < window)
    return torch.cat([ctx, own.expand(ctx.shape[0], -1, -1)], dim=2)[:, None]


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context | block] through the same k_proj/v_proj."""

    def __init__(self, config) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q, rope_k, mask: Tensor) -> Tensor:
        bsz, q_len, _ = x.shape  # x [B, Q, H], ctx [B, S, H]
        kv_in = torch.cat([ctx, x], dim=1)  # [B, S+Q, H]
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, kv_len, self.num_kv_heads, self.head_dim)).transpose(
            1, 2
        )
        v = self.v_proj(kv_in).view(bsz, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, *rope_q).to(v.dtype)
        k = apply_rope(k, *rope_k).to(v.dtype)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, Hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q, rope_k, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (weights only: the embedding and LM head are the target's)."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]  # noqa: RUF012 (transformers reads a plain class list)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.target_layer_ids = list(_dflash_value(config, "target_layer_ids"))
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = int(_dflash_value(config, "mask_token_id"))
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.layer_windows = [config.sliding_window if t == SLIDING_ATTENTION else None for t in layer_types]
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        # fp32 angles in a plain attribute (not a buffer), so a dtype cast of the model cannot round them;
        # computed at the first forward (from_pretrained builds the module on the meta device).
        self._rope: tuple[Tensor, float] | None = None
        self.post_init()

    @property
    def rope(self) -> tuple[Tensor, float]:
        """(inv_freq [head_dim/2] fp32, attention factor)."""
        if self._rope is None:
            with torch.device("cpu"):
                self._rope = rope_inv_freq(self.config)
        return self._rope

    def forward(
        self,
        position_ids: Tensor,
        attention_mask: Tensor | None = None,
        noise_embedding: Tensor | None = None,
        target_hidden: Tensor | None = None,
        **kwargs,
    ) -> Tensor:
        """Final-norm hidden states of the block, [B, Q, H].

        target_hidden [B, S, k*H]: the target's features of the S context tokens; noise_embedding [B, Q, H]:
        the target's embedding of the block ``[last token, MASK x (Q-1)]``; position_ids [B, S+Q]: the
        context's positions, then the block's. ``attention_mask`` [B, 1, Q, S+Q] bool overrides every layer's
        mask (None: each layer's own, ``block_mask``)."""
        dtype = self.fc.weight.dtype
        ctx_len = target_hidden.shape[1]
        x = noise_embedding.to(dtype)
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))  # [B, S, H], shared by all layers
        inv_freq, scale = self.rope
        rope_q = rope_cos_sin(inv_freq, position_ids[:, ctx_len:], dtype, scale)
        rope_k = rope_cos_sin(inv_freq, position_ids, dtype, scale)
        masks = {}
        for layer, window in zip(self.layers, self.layer_windows, strict=True):
            if attention_mask is not None:
                mask = attention_mask
            else:
                if window not in masks:
                    masks[window] = block_mask(position_ids, ctx_len, window)
                mask = masks[window]
            x = layer(x, ctx, rope_q, rope_k, mask)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor, output_head: nn.Module) -> Tensor:
        weight = output_head.weight
        return F.linear(hidden.to(weight.dtype), weight)

    @torch.inference_mode()
    def draft(self, target: nn.Module, tokens: Tensor, features: Tensor) -> Tensor:
        """Greedy draft [bs-1] of the block after the context: tokens [n+1] (the last is the block's first
        token), features [n, k*H] (the target's, of the n verified tokens)."""
        device = self.fc.weight.device
        n = features.shape[0]
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = tokens[-1]
        embed = target.get_input_embeddings().weight
        noise = F.embedding(block.to(embed.device), embed).to(device)
        positions = torch.arange(n + self.block_size, device=device)[None]
        hidden = self(position_ids=positions, noise_embedding=noise, target_hidden=features[None].to(device))
        logits = self.compute_logits(hidden[:, 1:], target.get_output_embeddings())
        return logits[0].argmax(-1)

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: Tensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        return_stats: bool = False,
        **kwargs,
    ):
        """Greedy DFlash speculative decoding of ``input_ids`` [1, P] with an HF causal LM ``target``:
        output ids [1, P + new] (the prompt first), the new tokens the target's own greedy decoding, ending
        after a stop token (kept) or ``max_new_tokens``. ``return_stats``: a namespace with ``output_ids``,
        ``num_input_tokens``, ``num_output_tokens``, ``time_to_first_token``, ``time_per_output_token`` and
        ``acceptance_lengths`` (tokens each draft-verify step produced, the target's own included)."""
        if temperature and temperature > 0:
            raise ValueError(
                f"temperature={temperature}: this drafter's spec_generate decodes greedily only "
                "(temperature=0); sampling needs the DFlash reference package"
            )
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [1, P] (one prompt), got shape {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.eval()
        device = next(target.parameters()).device
        stop = {int(t) for t in (stop_token_ids or ())}
        ids = input_ids[0].to(device, torch.long)
        cache_arg = (
            "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"
        )
        _sync(device)
        t0 = time.perf_counter()
        out = target(
            input_ids=ids[None], use_cache=True, output_hidden_states=True, logits_to_keep=1, return_dict=True
        )
        cache = _returned_cache(out)
        tokens = [int(out.logits[0, -1].argmax())]
        features = self._features(out.hidden_states)  # [P, k*H]
        _sync(device)
        first_s = time.perf_counter() - t0
        steps: list[int] = []
        while len(tokens) < max_new_tokens and tokens[-1] not in stop:
            n = features.shape[0]  # verified tokens; tokens[-1] sits at position n
            context = torch.cat([ids, torch.tensor(tokens, device=device)])  # [n+1]
            draft = self.draft(target, context, features).to(device)  # [bs-1]
            block = torch.cat([context[-1:], draft])  # [bs] at positions n..n+bs-1
            out = target(
                input_ids=block[None],
                **{cache_arg: cache},
                use_cache=True,
                output_hidden_states=True,
                return_dict=True,
            )
            cache = _returned_cache(out)
            greedy = out.logits[0].argmax(-1)  # [bs]: the target's token after each block position
            accepted = int((draft == greedy[:-1]).long().cumprod(0).sum())
            produced = [int(t) for t in draft[:accepted]] + [int(greedy[accepted])]
            keep = next((i + 1 for i, t in enumerate(produced) if t in stop), len(produced))
            keep = min(keep, max_new_tokens - len(tokens))
            tokens += produced[:keep]
            features = torch.cat([features, self._features(out.hidden_states)[:keep]])
            _crop(cache, n + keep)
            steps.append(keep)
        _sync(device)
        output_ids = torch.cat([ids, torch.tensor(tokens, device=device)])[None]
        if not return_stats:
            return output_ids
        return SimpleNamespace(
            output_ids=output_ids,
            num_input_tokens=ids.numel(),
            num_output_tokens=len(tokens),
            time_to_first_token=first_s,
            time_per_output_token=(time.perf_counter() - t0 - first_s) / len(tokens),
            acceptance_lengths=steps,
        )

    def _features(self, hidden_states) -> Tensor:
        """HF ``hidden_states`` (embeddings first) -> [T, k*H]: the outputs of target layers ``target_layer_ids``."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)[0]


def _returned_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _crop(cache, length: int) -> None:
    """Cut the target's KV cache back to ``length`` tokens (``crop(-n)`` removes n on every transformers 5)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)
    if cache.get_seq_length() != length:
        raise RuntimeError(
            f"the target's KV cache ({type(cache).__name__}) holds {cache.get_seq_length()} tokens after cropping "
            f"to {length}: it cannot be rolled back (recurrent or sliding-window layers), so spec_generate cannot "
            "run on this target"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
