"""One training step on the real target's features equals speculators': our ``DFlashDrafter`` and
speculators 0.9.0's own DFlash (``speculators.models.dflash.DFlashDraftModel``, built by its
``from_training_args`` from the real target, with its draft config derived by its own
``create_transformer_layer_config``: another team's code for the same paper, its eager attention with its
own flex-style mask mod, its packing of rows by document, its targets rebuilt from the target's last hidden
state, its loss), given the same weights (mapped by name, ``speculators_weights.to_speculators``), the same two
real samples with the target's own features and the same anchors, give the same loss and the same gradient
for every drafter weight, in fp32 (measured: loss equal to the last digit, 25.2735843; every gradient
within 2.1e-7 relative; 62 anchors, 578 supervised slots).

Where the two differ by design, the test sets both sides alike (docs/performance.md, "The speculators
peer"): its labels are the target's argmax at anchor + k - 1 (ours: the data's token), so both sides
supervise only the positions where the two agree (the loss mask); its weighted loss is divided by the
count of supervised slots + 1e-5 (ours: by the sum of the slot weights), so our side divides the same way;
its slot weights are D-PACE by default (our exp decay is its ``fixed-exp-decay``) and its layers are
sliding-window and causal in the block unless ``--full-attention-indices`` names them.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dflash_pipe.bench.speculators_weights import speculators_layer_ids, to_speculators
from dflash_pipe.drafter import DFlashDrafter, DrafterConfig
from dflash_pipe.drafter.masks import sample_anchors, training_eligible
from dflash_pipe.drafter.target_parts import load_frozen_target_parts

from .same_step import assert_same_step
from .speculators_site import RegistryUnreachable, speculators_site

pytestmark = [pytest.mark.real, pytest.mark.filterwarnings("ignore::UserWarning")]

MASK_TOKEN = 16  # an unused special token of SmolLM2 (ids 3-16), as the real-model runs use
MAX_ANCHORS = 32
SEED = 0
EPS = 1e-5
"""Its loss denominator's epsilon (``speculators.losses.utils._LOSS_REDUCTION_EPS``)."""


@pytest.fixture(scope="module")
def speculators():
    try:
        site = speculators_site()
    except RegistryUnreachable as e:
        pytest.skip(f"package index unreachable, so speculators cannot be installed: {e}")
    sys.path.insert(0, str(site))
    try:
        import speculators.models.dflash.core as core
        from speculators.losses import resolve_loss_config
        from speculators.train.cli import create_transformer_layer_config

        yield core, resolve_loss_config, create_transformer_layer_config
    finally:
        sys.path.remove(str(site))


def _rows(samples, model, layer_ids):
    """Per sample: ids [T], loss mask [T] (True only where the target's argmax at p - 1 is the token at p),
    features [T, k*H] (``hidden_states[id + 1]``) and the last layer's output before the final norm [T, H]
    (what its targets are rebuilt from)."""
    out = []
    for s in samples:
        last = []
        hook = model.model.norm.register_forward_pre_hook(lambda _m, args, last=last: last.append(args[0]))
        with torch.no_grad():
            o = model(input_ids=s.input_ids[None], output_hidden_states=True)
        hook.remove()
        agree = torch.zeros_like(s.loss_mask)
        agree[1:] = o.logits[0, :-1].argmax(-1) == s.input_ids[1:]
        feats = torch.cat([o.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        out.append((s.input_ids, s.loss_mask & agree, feats, last[0][0]))
    return out


@pytest.mark.slow
def test_training_step_equals_speculators(speculators, smollm2_dir, hf_model, tokenizer, real_samples):
    core, resolve_loss_config, create_layer_config = speculators
    cfg = DrafterConfig.from_target(
        hf_model.config, tokenizer=tokenizer, num_layers=2, mask_token_id=MASK_TOKEN, max_anchors=MAX_ANCHORS
    )
    assert cfg.block_size == 16 and cfg.gamma == 7.0
    rows = _rows(real_samples[:2], hf_model, cfg.target_layer_ids)
    supervised = [int(m.sum()) for _, m, _, _ in rows]
    assert min(supervised) >= 40, supervised  # enough positions where the labels agree

    # ours: right-padded [B, S]
    width = max(ids.numel() for ids, *_ in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.bool)
    feats = torch.zeros(2, width, rows[0][2].shape[-1])
    for b, (i, m, f, _) in enumerate(rows):
        ids[b, : i.numel()], mask[b, : i.numel()], feats[b, : i.numel()] = i, m, f
    anchors, valid = sample_anchors(
        training_eligible(mask), MAX_ANCHORS, generator=torch.Generator().manual_seed(SEED)
    )
    assert anchors.shape == (2, MAX_ANCHORS) and int(valid.sum()) > MAX_ANCHORS  # padded slots: disabled

    embed, head = load_frozen_target_parts(smollm2_dir, dtype=torch.float32, device=torch.device("cpu"))
    torch.manual_seed(SEED)
    ours = DFlashDrafter(cfg, embed, head).train()
    with torch.no_grad():  # norms away from one, so their gradients and scales are tested too
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = ours(ids, feats, mask, generator=torch.Generator().manual_seed(SEED))
    count = out.slot_total.sum()  # supervised slots: its denominator
    loss = out.loss_sum / (count + EPS)
    loss.backward()

    # theirs: its draft config from the verifier and its own flags, every layer full attention
    layer_config = create_layer_config(
        verifier_name_or_path=str(smollm2_dir),
        num_layers=cfg.num_hidden_layers,
        draft_arch="qwen3",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=list(range(cfg.num_hidden_layers)),
    )
    shapes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert {k: getattr(layer_config, k) for k in shapes} == {k: getattr(cfg, k) for k in shapes}
    assert layer_config.rope_parameters["rope_theta"] == cfg.rope_theta
    theirs = core.DFlashDraftModel.from_training_args(
        verifier_config=layer_config,
        verifier_name_or_path=str(smollm2_dir),
        target_layer_ids=speculators_layer_ids(cfg.target_layer_ids),
        block_size=cfg.block_size,
        draft_vocab_size=cfg.vocab_size,
        mask_token_id=MASK_TOKEN,
        draft_attn_impl="eager",  # its own attention and float mask, not our SDPA call
    ).float()
    missing, unexpected = theirs.load_state_dict(
        to_speculators(ours.state_dict(), cfg.num_hidden_layers), strict=False
    )
    assert not unexpected and set(missing) == {
        "embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"
    }, (missing, unexpected)  # fmt: skip
    theirs.train()

    # its batch: both rows packed into one, told apart by document ids, positions restarting per row, and
    # padded as its collator pads (document -1, no loss): a block may run past the last row's end
    lengths = [i.numel() for i, *_ in rows]
    pad = cfg.block_size

    def packed(parts, fill=0):
        return torch.cat([*parts, torch.full((pad, *parts[0].shape[1:]), fill, dtype=parts[0].dtype)])[None]

    packed_anchors = torch.cat([anchors[0][valid[0]], anchors[1][valid[1]] + lengths[0]])  # real ones only
    core.select_anchors = lambda loss_mask, n, bs: (
        packed_anchors,
        torch.ones_like(packed_anchors, dtype=torch.bool),
    )
    _, their_loss, metrics = theirs(
        hidden_states=packed([f for _, _, f, _ in rows]),
        input_ids=packed([i for i, *_ in rows]),
        loss_mask=packed([m.long() for _, m, _, _ in rows]),
        verifier_last_hidden_states=packed([h for *_, h in rows]),
        document_ids=packed([torch.full((n,), d) for d, n in enumerate(lengths)], fill=-1),
        position_ids=packed([torch.arange(n) for n in lengths]),
        loss_config=resolve_loss_config("ce", "eager"),
        gamma=cfg.gamma,
        max_anchors=packed_anchors.numel(),
        per_position_loss_weight="fixed-exp-decay",
    )
    their_loss.backward()

    # the same slots scored, and the same slots right (its accuracy counts against the target's argmax)
    assert float(metrics["full_acc_total"]) == float(count)
    assert float(metrics["full_acc_sum"]) == float(out.slot_correct.sum())
    assert_same_step(ours, theirs, loss.item(), their_loss.item(), frozen=[embed, head])
