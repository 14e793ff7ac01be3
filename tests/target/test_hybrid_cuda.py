"""A hybrid target on the GPU through flash-linear-attention's varlen kernels: every sample of a packed row
equals that sample alone through the plain HF model (fp32)."""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_pipe.target import TargetCore
from tests.target.hybrid_models import per_sample_reference, relative_errors, save_hybrid
from tests.target.inputs import packed_batch

LENGTHS = [7, 130, 1, 64, 33]
LAYERS = (0, 1, 2, 3, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_fla_path_on_cuda_equals_each_sample_alone(family, tmp_path, caplog):
    """The real kernels: flash-linear-attention with cu_seqlens, compiled flex attention, fp32 on the GPU,
    against each sample alone through the plain HF model on the GPU (fp32; its delta rule is fla's too, its
    conv torch's). Measured on an H200: at most 8.8e-6 (bench/results/h200_hybrid_target/cuda_test_log.txt);
    the bound leaves room for fla's chunked kernels, which may multiply in tf32 on other GPUs."""
    pytest.importorskip("fla")
    model_dir = save_hybrid(family, tmp_path / family)
    with caplog.at_level(logging.INFO, logger="dflash_pipe.target"):
        core = TargetCore(model_dir, LAYERS, torch.device("cuda"), torch.float32)
    assert "3 through flash-linear-attention with sample boundaries" in caplog.text
    feats = core.features(packed_batch(LENGTHS), LENGTHS).cpu()
    reference = per_sample_reference(model_dir, packed_batch(LENGTHS), LENGTHS, LAYERS, device="cuda")
    errors = relative_errors(feats, reference, LENGTHS)
    print(family, "fla fp32 relative errors per sample:", errors)
    assert max(errors) <= 1e-4, errors
