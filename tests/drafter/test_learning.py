"""The drafter learns: tau after ~150 AdamW steps on a tiny Qwen3 target beats the untrained drafter.

The target is randomly initialised; its training data is its own greedy continuations, so the
teacher-forced acceptance measured against its greedy predictions is learnable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from transformers import Qwen3ForCausalLM

from dflash_pipe.drafter import (
    AcceptanceCounts,
    DFlashDrafter,
    DrafterConfig,
    evaluate_acceptance,
    render_acceptance_table,
)
from tests.tiny_models import tiny_qwen3_config

VOCAB, PROMPT, GEN = 48, 4, 28


@dataclass(frozen=True)
class _Sample:
    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


class TinyTarget:
    """Stand-in for TargetCore: packed [T] in, features / greedy predictions out."""

    def __init__(self, model: Qwen3ForCausalLM, layer_ids: Sequence[int]) -> None:
        self.model, self.layer_ids = model.eval(), list(layer_ids)

    def _split(self, input_ids: torch.Tensor, lengths: Sequence[int]):
        return torch.split(input_ids, list(lengths))

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        out = []
        for seq in self._split(input_ids, lengths):
            hs = self.model(seq[None], output_hidden_states=True).hidden_states
            out.append(torch.cat([hs[i + 1][0] for i in self.layer_ids], dim=-1))
        return torch.cat(out)

    @torch.no_grad()
    def greedy_next(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        return torch.cat(
            [self.model(seq[None]).logits[0].argmax(-1) for seq in self._split(input_ids, lengths)]
        )


def _setup(num_samples: int = 24):
    torch.manual_seed(0)
    tc = tiny_qwen3_config(
        hidden_size=48,
        intermediate_size=96,
        head_dim=12,
        num_hidden_layers=4,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.3,  # confident random target: peaked greedy predictions
    )
    target = Qwen3ForCausalLM(tc).eval()
    prompts = torch.randint(0, VOCAB - 1, (num_samples, PROMPT))
    with torch.no_grad():
        seqs = target.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=GEN,
            min_new_tokens=GEN,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    loss_mask = torch.zeros_like(seqs, dtype=torch.bool)
    loss_mask[:, PROMPT:] = True
    samples = [_Sample(sample_id=i, input_ids=seqs[i], loss_mask=loss_mask[i]) for i in range(num_samples)]
    cfg = DrafterConfig.from_target(
        tc, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, max_anchors=16, attention_backend="sdpa"
    )
    return target, cfg, samples


def test_training_raises_tau() -> None:
    target, cfg, samples = _setup()
    core = TinyTarget(target, cfg.target_layer_ids)
    drafter = DFlashDrafter(cfg, target.model.embed_tokens, target.lm_head)
    ids = torch.stack([s.input_ids for s in samples])  # [N, S] (equal lengths)
    lm = torch.stack([s.loss_mask for s in samples])
    feats = core.features(ids.flatten(), [ids.shape[1]] * len(samples)).view(*ids.shape, -1)
    before = evaluate_acceptance(core, drafter, samples, num_anchors=16, progress=False, seed=1)

    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    first = last = None
    for step in range(150):
        rows = torch.randint(0, len(samples), (8,), generator=gen)
        out = drafter(ids[rows], feats[rows], lm[rows], generator=gen)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        first = float(out.loss.detach()) if step == 0 else first
        last = float(out.loss.detach())
    after = evaluate_acceptance(core, drafter, samples, num_anchors=16, progress=False, seed=1)

    assert target.model.embed_tokens.weight.grad is None  # frozen target parts stay untouched
    assert last < 0.6 * first
    assert after.tau > before.tau + 0.5, (before.tau, after.tau)
    assert after.counts.anchors == before.counts.anchors > 0
    table = render_acceptance_table(after)
    Console(width=100, record=True, quiet=True).print(table)
    assert table.row_count == cfg.block_size - 1


def test_counts_add_up() -> None:
    a = AcceptanceCounts(anchors=2, accepted_total=3, per_slot_accepted=torch.tensor([0, 2, 1, 0]))
    b = AcceptanceCounts(anchors=1, accepted_total=0, per_slot_accepted=torch.tensor([0, 0, 0, 0]))
    c = a + b
    assert c.anchors == 3 and c.accepted_total == 3 and c.tau == 2.0
    assert c.per_slot_rate.tolist() == [0.0, 2 / 3, 1 / 3, 0.0]
