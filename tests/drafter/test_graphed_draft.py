"""Drafting from captured graphs drafts what the drafter's own forward drafts (``drafter_proposer``).

On CPU the proposer runs its static buffers eagerly (``capture=False``): the bucketed, padded context and the
reused buffers are what a graph replays, so equality here is the buffers' correctness; on CUDA the capture
itself is compared too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_pipe.drafter.generate_eval import evaluate_generate
from dflash_pipe.drafter.graphed_draft import GraphedProposer, graphs_apply
from dflash_pipe.drafter.speculate import drafter_proposer

from .conftest import tiny_config, tiny_drafter


def _sharp(cfg) -> object:
    """A tiny drafter whose drafts depend on the context (the default init's logits are near-flat, so every
    context drafts the same token and equal drafts would prove little)."""
    drafter = tiny_drafter(cfg)
    drafter.reset_parameters(std=0.5)
    return drafter


def _context(drafter, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 49, (n + 1,), generator=g)
    features = torch.randn(n, drafter.cfg.feature_size, generator=g)
    return tokens, features


# lengths inside a bucket, at its edge, past it, then shorter again (the buffers hold a longer context's rows)
LENGTHS = (5, 7, 8, 19, 3, 12)


@pytest.mark.parametrize("windows", [None, (3, None)], ids=["full", "sliding"])
@torch.no_grad()
def test_graphed_buffers_draft_what_the_forward_drafts(windows) -> None:
    cfg = tiny_config(block_size=4, attention_backend="sdpa")
    if windows is not None:
        cfg = dataclasses.replace(cfg, layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    drafter = _sharp(cfg)
    plain, graphed = drafter_proposer(drafter), GraphedProposer(drafter, bucket=8, capture=False)
    seen = []
    for i, n in enumerate(LENGTHS):
        tokens, features = _context(drafter, n, seed=i)
        want = plain(tokens, features)
        got = graphed(tokens, features)
        assert got.shape == (cfg.block_size - 1,)
        assert torch.equal(got, want), f"context of {n} tokens"
        seen.append(want)
    assert sorted(graphed._steps) == [8, 16, 24]  # one set of buffers per bucket reached
    assert len({tuple(d.tolist()) for d in seen}) > 1  # the drafts depend on the context


def _prefixes(drafter, lengths, seed):
    """The contexts one sequence drafts from as it grows: each a prefix of the longest."""
    tokens, features = _context(drafter, max(lengths), seed)
    return [(tokens[: n + 1], features[:n]) for n in lengths]


@torch.no_grad()
def test_check_counts_every_draft_and_keeps_where_one_differed() -> None:
    """``check``: every draft compared with the forward's once its sequence ends (a shorter context starts
    another); a replay that drafted otherwise once (a passing fault: it drafts right when replayed again,
    and its buffers' eager run is right) is counted and kept with where it happened."""
    drafter = _sharp(tiny_config(block_size=4, attention_backend="sdpa"))
    graphed = GraphedProposer(drafter, bucket=8, capture=False, check=True)
    first, second = _prefixes(drafter, (5, 7, 8, 19), seed=1), _prefixes(drafter, (3, 12), seed=2)
    for tokens, features in first + second:
        graphed(tokens, features)
    assert graphed._pending and graphed.checked == len(first)  # the first sequence settled by the second
    assert graphed.check_report() == {"checked": len(first) + len(second), "mismatched": 0, "first": []}

    step = graphed._steps[16]
    right, runs = step.run, []

    def once_wrong():  # the first replay drafts other tokens, the next ones right
        runs.append(1)
        return (right() + 1) % 49 if len(runs) == 1 else right()

    step.run = once_wrong
    (tokens, features), *_ = _prefixes(drafter, (12,), seed=9)
    wrong = graphed(tokens, features)
    report = graphed.check_report()
    assert report["checked"] == len(first) + len(second) + 1 and report["mismatched"] == 1
    (kept,) = report["first"]
    assert kept["step"] == report["checked"] and kept["context"] == 12 and kept["bucket"] == 16
    assert kept["buckets_built"] == [8, 16, 24] and kept["first_slot"] == 1
    assert kept["graphed"] == wrong.tolist() != kept["forward"]
    assert kept["replayed_again_equal_forward"] is True  # passing, not a stale graph
    assert kept["buffers_eager_equal_forward"] is True and kept["recaptured_equal_forward"] is True
    assert kept["weights_moved"] == []


@torch.no_grad()
def test_check_names_a_weight_that_moved_since_the_capture() -> None:
    """A graph reads its weights where they were at capture: a weight replaced since (e.g. a target whose
    embedding was copied) is named, its replays stay wrong, and a step built afresh agrees again."""
    drafter = _sharp(tiny_config(block_size=4, attention_backend="sdpa"))
    graphed = GraphedProposer(drafter, bucket=8, capture=False, check=True)
    (short, longer) = _prefixes(drafter, (4, 5), seed=0)
    graphed(*short)
    step = graphed._steps[8]
    stale = step.run
    drafter.fc.weight.data = drafter.fc.weight.data * 2.0  # new storage, as a moved weight has
    step.run = lambda: (stale() + 1) % 49  # what a graph reading the old storage would draft
    graphed(*longer)
    report = graphed.check_report()
    assert report["checked"] == 2 and report["mismatched"] == 1  # the draft before the move was right
    (kept,) = report["first"]
    assert kept["weights_moved"] == ["fc.weight"] and kept["replayed_again_equal_forward"] is False
    assert kept["recaptured_equal_forward"] is True


@torch.no_grad()
def test_a_context_row_past_the_anchor_cannot_change_the_draft() -> None:
    """Stale rows of a longer context stay in the bucket's buffers: they must be invisible."""
    drafter = _sharp(tiny_config(block_size=4))
    graphed = GraphedProposer(drafter, bucket=16, capture=False)
    tokens, features = _context(drafter, 6, seed=1)
    first = graphed(tokens, features)
    step = graphed._steps[16]
    step.features[0, 6:].normal_()  # what a longer context leaves there; the mask must hide it
    step.ids[0, 7:] = 3
    assert torch.equal(step.run(), first)


def test_bad_inputs_are_refused() -> None:
    drafter = tiny_drafter()
    with pytest.raises(ValueError, match="bucket must be >= 1"):
        GraphedProposer(drafter, bucket=0)
    with pytest.raises(ValueError, match="capture=True needs a drafter on CUDA"):
        GraphedProposer(drafter, capture=True)
    tokens, features = _context(drafter, 4, seed=0)
    with pytest.raises(ValueError, match="verified tokens plus the block's first"):
        GraphedProposer(drafter, capture=False)(tokens[:-1], features)
    assert not graphs_apply(drafter)
    with pytest.raises(ValueError, match="captured only for a drafter on CUDA"):
        evaluate_generate(drafter, drafter, [tokens], max_new_tokens=4, stop_ids=(), graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture")
@torch.no_grad()
def test_captured_graphs_draft_what_the_forward_drafts_on_cuda() -> None:
    drafter = _sharp(tiny_config(block_size=4, attention_backend="sdpa")).cuda()
    drafter.embed_tokens.cuda(), drafter.lm_head.cuda()  # the target's parts, not the drafter's modules
    assert graphs_apply(drafter)
    plain, graphed = drafter_proposer(drafter), GraphedProposer(drafter, bucket=8)
    for i, n in enumerate(LENGTHS):
        tokens, features = (t.cuda() for t in _context(drafter, n, seed=i))
        assert torch.equal(graphed(tokens, features), plain(tokens, features)), f"context of {n} tokens"
