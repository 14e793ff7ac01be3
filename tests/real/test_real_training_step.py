"""One training step on the real target's features equals SpecForge's: our ``DFlashDrafter`` and SpecForge
0.2.0's own DFlash draft model and training wrapper (``specforge.modeling.draft.dflash.DFlashDraftModel``,
``specforge.algorithms.common.dflash_family_model.OnlineDFlashModel``: another team's code for the same
paper, its eager attention with its own dense mask, its labels, loss weights and normalisation), given the
same weights, the same two real samples with the target's own features, and the same anchors, give the same
loss and the same gradient for every parameter, in fp32 (measured: loss within 2e-7, every gradient within
3e-7 relative; a context mask of ``<=`` instead of ``<`` the anchor moves the loss by 9e-4).

SpecForge pins another torch and transformers; only those two modules are imported here, from its unpacked
wheel (``packages``), under the installed ones.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dflash_pipe.drafter import DFlashDrafter, DrafterConfig
from dflash_pipe.drafter.masks import sample_anchors, training_eligible
from dflash_pipe.drafter.target_parts import load_frozen_target_parts

from .same_step import assert_same_step

pytestmark = [
    pytest.mark.real,
    pytest.mark.filterwarnings("ignore:flash_attn is not found"),  # SpecForge's package __init__ says it
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
]

MASK_TOKEN = 16  # an unused special token of SmolLM2 (ids 3-16), as the real-model runs use
MAX_ANCHORS = 32
SEED = 0


@pytest.fixture(scope="module")
def specforge(real):
    sys.path.insert(0, str(real.specforge))
    try:
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel
    finally:
        sys.path.remove(str(real.specforge))
    return DFlashDraftModel, OnlineDFlashModel


def _batch(samples, model, layer_ids):
    """Right-padded ids [B, S], loss mask [B, S] and the target's features [B, S, k*H] (an HF forward
    with ``output_hidden_states``, as SpecForge's capture writes them)."""
    width = max(s.input_ids.numel() for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    feats = torch.zeros(len(samples), width, len(layer_ids) * model.config.hidden_size)
    for b, s in enumerate(samples):
        n = s.input_ids.numel()
        ids[b, :n], mask[b, :n] = s.input_ids, s.loss_mask
        with torch.no_grad():
            hs = model(input_ids=s.input_ids[None], output_hidden_states=True).hidden_states
        feats[b, :n] = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)
    return ids, mask, feats


def _specforge_model(cfg: DrafterConfig, draft_cls):
    from transformers import Qwen3Config

    config = Qwen3Config(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        num_hidden_layers=cfg.num_hidden_layers,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False,
        layer_types=list(cfg.layer_types),
        num_target_layers=cfg.num_target_layers,
        block_size=cfg.block_size,
        dflash_config={"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id},
    )
    config._attn_implementation = "eager"  # its own attention and mask handling, not our SDPA call
    return draft_cls(config).float()


@pytest.mark.slow
def test_training_step_equals_specforge(specforge, smollm2_dir, hf_model, tokenizer, real_samples):
    draft_cls, online_cls = specforge
    cfg = DrafterConfig.from_target(
        hf_model.config, tokenizer=tokenizer, num_layers=2, mask_token_id=MASK_TOKEN, max_anchors=MAX_ANCHORS
    )
    assert cfg.block_size == 16 and cfg.gamma == 7.0
    samples = real_samples[:2]
    ids, mask, feats = _batch(samples, hf_model, cfg.target_layer_ids)
    assert ids.shape[1] > min(s.input_ids.numel() for s in samples)  # one row right-padded

    # the anchors our drafter samples from this seed: every one real (both rows have more candidates)
    anchors, valid = sample_anchors(
        training_eligible(mask), MAX_ANCHORS, generator=torch.Generator().manual_seed(SEED)
    )
    assert anchors.shape == (2, MAX_ANCHORS) and bool(valid.all())

    embed, head = load_frozen_target_parts(smollm2_dir, dtype=torch.float32, device=torch.device("cpu"))
    torch.manual_seed(SEED)
    ours = DFlashDrafter(cfg, embed, head).train()
    with torch.no_grad():  # norms away from one, so their gradients and scales are tested too
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = ours(ids, feats, mask, generator=torch.Generator().manual_seed(SEED))
    loss = out.loss_sum / out.weight_sum
    loss.backward()

    theirs = _specforge_model(cfg, draft_cls)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    online = online_cls(
        theirs,
        target_lm_head=head,
        target_embed_tokens=embed,
        mask_token_id=MASK_TOKEN,
        block_size=cfg.block_size,
        attention_backend="sdpa",  # its dense boolean mask (flex needs compile)
        num_anchors=MAX_ANCHORS,
        loss_decay_gamma=cfg.gamma,
    ).train()
    online._sample_anchor_positions = lambda seq_len, loss_mask, device: (anchors, valid)
    their_loss, _, _ = online(ids, feats, mask.float())
    their_loss.backward()

    assert_same_step(ours, theirs, loss.item(), their_loss.item(), frozen=[embed, head])
