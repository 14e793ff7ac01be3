"""greedy_next is the argmax of a plain forward, per sample."""

from __future__ import annotations

import torch

from dflash_pipe.target import TargetCore
from tests.target.inputs import packed_batch


def test_greedy_next_equals_plain_argmax(model_dir):
    core = TargetCore(model_dir, [1], "cpu", torch.float32)
    lengths = [6, 11, 2]
    ids = packed_batch(lengths, seed=3)
    got = core.greedy_next(ids, lengths)
    assert got.shape == (sum(lengths),) and got.dtype == torch.int64
    with torch.no_grad():
        ref = torch.cat([core.model(input_ids=c[None]).logits[0].argmax(-1) for c in ids.split(lengths)])
    assert torch.equal(got, ref)
