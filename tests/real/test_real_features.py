"""TargetCore's features of the real target, three real samples packed into one row, equal HF's
``output_hidden_states`` of each sample run alone (``hidden_states[id + 1]``) at the default feature layers
and the first and last layer (HF's final norm applied to the last): packing leaks nothing across real
samples, with SDPA's dense mask as with flex attention's block mask."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.config.drafter import default_target_layer_ids
from dflash_pipe.target import TargetCore

pytestmark = [
    pytest.mark.real,
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

LAYER_IDS = (*default_target_layer_ids(30, 5), 0, 29)
SAMPLES = 3


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_packed_features_equal_hf_per_sample(smollm2_dir, hf_model, real_samples, attention):
    samples = real_samples[:SAMPLES]
    lengths = [s.input_ids.numel() for s in samples]
    assert len(set(lengths)) > 1, lengths  # samples of different lengths: boundaries inside the row
    core = TargetCore(smollm2_dir, LAYER_IDS, "cpu", torch.float32, packing="packed", attention=attention)
    feats = core.features(torch.cat([s.input_ids for s in samples]), lengths)
    assert feats.shape == (sum(lengths), len(LAYER_IDS) * 576) and feats.dtype == torch.float32
    for b, (sample, got) in enumerate(zip(samples, feats.split(lengths), strict=True)):
        with torch.no_grad():
            hs = hf_model(input_ids=sample.input_ids[None], output_hidden_states=True).hidden_states
        alone = torch.cat([hs[i + 1][0] for i in LAYER_IDS], dim=-1)  # [T, k*H]
        if b == 0 and attention == "sdpa":  # a sample alone: HF's own kernels on the same values, bit for bit
            assert torch.equal(core.features(sample.input_ids, [lengths[0]]), alone)
        # (In the packed row the matmuls have more rows, which the CPU BLAS may block otherwise: bits differ.)
        # SmolLM2's massive activations (|h| ~ 2.5e4 from layer 14 on) make fp32 rounding of another matmul
        # shape ~4e-3 absolute: compare per layer and per token, relative to the reference's norm. HF's own
        # padded batch differs from a sample alone by up to 1.3e-6 so; a leak across samples is % sized.
        diff = (got - alone).view(len(got), len(LAYER_IDS), -1).norm(dim=-1)  # [T, k]
        ref = alone.view(len(got), len(LAYER_IDS), -1).norm(dim=-1)
        assert float((diff.norm(dim=0) / ref.norm(dim=0)).max()) < 1e-5, b
        assert float((diff / ref).max()) < 1e-4, b
