"""Shared fixtures: tiny random HF targets saved to disk (built from configs, no downloads)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3ForCausalLM

from dflash_pipe.compute.compile import FLEX_MIN_HEAD_DIM
from tests.target.inputs import NUM_LAYERS, VOCAB
from tests.tiny_models import tiny_qwen3_config

# Make the repo importable when the package is not installed (plain `pytest tests/target`).
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 16: the smallest Inductor's flex_attention kernels support, so the CUDA tests run flex.
    cfg = tiny_qwen3_config(
        vocab_size=VOCAB, num_hidden_layers=NUM_LAYERS, tie_word_embeddings=True, head_dim=FLEX_MIN_HEAD_DIM
    )
    torch.manual_seed(0)
    return _save(Qwen3ForCausalLM(cfg), tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=3,  # head_dim 16 (see qwen3_dir)
        num_key_value_heads=3,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    return _save(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("llama"))


@pytest.fixture(params=["qwen3", "llama"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls are much faster on one thread, and the CI box is shared by other test runs (use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
