"""Session fixtures of the real-model tests: SmolLM2-135M-Instruct (a trained target, from its package's GGUF
file, converted once to a Hugging Face folder and shared by every test), its tokenizer, and real ShareGPT
prompts.

Every test module here is marked ``real`` (``pytest -m "not real"`` leaves them out). They skip only when the package
index cannot be reached (``packages.RegistryUnreachable``); a download or conversion that fails otherwise
fails them. Cost on 2 cores: the conversion once (~45 s, then cached under ``$DFLASH_PIPE_CACHE/gguf``), the
download once (``packages``), then about a minute for all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .packages import RealFiles, RegistryUnreachable, real_files

PROMPTS = 4
PROMPT_TOKENS = 200
"""A ShareGPT prompt is cut to its first tokens (real text, short enough for CPU forwards)."""
SAMPLE_TOKENS = 256
"""Training samples are cut to this many tokens (``DataConfig.max_length``)."""


@pytest.fixture(scope="session")
def real() -> RealFiles:
    try:
        return real_files()
    except RegistryUnreachable as e:
        pytest.skip(f"package index unreachable, so the real target and data cannot be fetched: {e}")


@pytest.fixture(scope="session")
def smollm2_dir(real: RealFiles) -> Path:
    """The GGUF file's converted folder (dflash-pipe's own conversion, as ``--target-model FILE.gguf``)."""
    from dflash_pipe.target.gguf import resolve_target

    return resolve_target(real.gguf, say=None)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def hf_model(smollm2_dir: Path):
    """The converted target as a plain HF model, fp32, SDPA: the reference the tests compare against."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="session")
def sharegpt_prompts(real: RealFiles, tokenizer) -> list[str]:
    """The first ``PROMPTS`` non-empty human turns that open a ShareGPT record (read with dflash-pipe's own
    array reader from the cut-short file), each cut to ``PROMPT_TOKENS`` tokens."""
    from dflash_pipe.data.arrays import ArrayRecords, NotJson

    prompts = []
    for _, _, record in ArrayRecords(real.sharegpt):
        assert not isinstance(record, NotJson), record
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            ids = tokenizer(turns[0]["value"], add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]
            prompts.append(tokenizer.decode(ids))
        if len(prompts) == PROMPTS:
            return prompts
    raise AssertionError(f"{real.sharegpt}: fewer than {PROMPTS} human prompts")


@pytest.fixture(scope="session")
def real_samples(real: RealFiles, tokenizer) -> list:
    """Training samples of the ShareGPT head as dflash-pipe's data path makes them (its array reader,
    the ChatML template, loss on assistant tokens), cut to ``SAMPLE_TOKENS``."""
    from dflash_pipe.data.config import DataConfig
    from dflash_pipe.data.loader import load_samples

    cfg = DataConfig(path=real.sharegpt, max_length=SAMPLE_TOKENS, tokenize_workers=0)
    return list(load_samples(cfg, tokenizer).samples)
