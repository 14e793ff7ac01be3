"""Every target family: TargetCore's features of a 3-sample batch against each sample run alone through the
plain HF model (the checkpoint's own class, eager attention, ``output_hidden_states=True``,
``hidden_states[id + 1]``), fp32 CPU, relative Frobenius error <= 1e-5 per sample.

Each family is a tiny random checkpoint saved with ``save_pretrained`` the way the Hub holds it
(tests/target/families.py) and loaded back through ``TargetCore`` as the producer loads it. Rows: packed
(the producer's default, SDPA on CPU), packed through the flex path where TargetCore would pick flex on a
GPU (eager flex_attention here), and padded. Each packed row also asserts the path the family runs: a
family that silently fell back to padded rows would pass the error check but not this one.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import transformers

from dflash_pipe.target import TargetCore
from dflash_pipe.target.families import UnsupportedTargetError
from dflash_pipe.target.packing import plain_causal
from tests.target.families import FAMILIES, LAYERS, VOCAB

LENGTHS = [7, 10, 6]
"""Three samples, each longer than the sliding window (4) and the causal conv (4) of the tiny configs."""
LAYER_IDS = tuple(range(LAYERS))
"""Every layer: each layer type of the hybrids, and the last one (HF's normed final output)."""
TOLERANCE = 1e-5
pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: family.save(root / name) for name, family in FAMILIES.items()}


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB - 8, (sum(LENGTHS),), generator=gen)  # below the image/video token ids


@functools.cache
def _reference(row: str, path: Path, ids: tuple[int, ...]) -> list[torch.Tensor]:
    return reference(row, path, torch.tensor(ids))


def reference(row: str, path: Path, ids: torch.Tensor) -> list[torch.Tensor]:
    """``[len, k*H]`` per sample: the checkpoint's own HF class on that sample alone."""
    model_class = getattr(transformers, FAMILIES[row].model_class)
    model = model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for sample in ids.split(LENGTHS):
            hidden = model(input_ids=sample[None], output_hidden_states=True, use_cache=False).hidden_states
            out.append(torch.cat([hidden[i + 1][0] for i in LAYER_IDS], dim=-1))
    return out


def relative_errors(features: torch.Tensor, want: list[torch.Tensor]) -> list[float]:
    return [float((f - w).norm() / w.norm()) for f, w in zip(features.split(LENGTHS), want, strict=True)]


def paths(row: str) -> list[tuple[str, str | None]]:
    """(packing, attention) pairs the row is checked on."""
    rows = [("packed", None), ("padded", None)]
    text = FAMILIES[row].config(VOCAB).get_text_config()
    if plain_causal(text) and not FAMILIES[row].padded:
        rows.append(("packed", "flex"))  # what TargetCore picks on a GPU for this family
    return rows


CASES = [(row, packing, attention) for row in FAMILIES for packing, attention in paths(row)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("row", "packing", "attention"), CASES, ids=[f"{r}-{p}{'-' + a if a else ''}" for r, p, a in CASES]
)
def test_features_equal_each_sample_alone(row, packing, attention, checkpoints, batch):
    path = checkpoints[row]
    core = TargetCore(path, LAYER_IDS, "cpu", torch.float32, packing=packing, attention=attention)
    errors = relative_errors(core.features(batch, LENGTHS), _reference(row, path, tuple(batch.tolist())))
    assert max(errors) <= TOLERANCE, f"{row} {packing}/{core.attention}: relative errors per sample {errors}"
    expected = "padded" if packing == "padded" or FAMILIES[row].padded else "packed"
    assert core.packing == expected, (
        f"{row}: asked for {packing} rows, runs {core.packing} (wanted {expected})"
    )


def test_every_family_of_the_issue_has_a_row():
    """Each family the issue names has a row, and a row is left out only where the installed transformers
    lacks its classes (5.17 and 5.24 have them all)."""
    from tests.target import families

    wanted = {
        "qwen3", "llama", "mistral", "qwen3_moe", "glm4_moe", "gemma3-text", "gemma3-multimodal", "gpt_oss",
        "deepseek_v3", "kimi_k25", "qwen3_5-text", "qwen3_5-multimodal", "qwen3_5_moe", "qwen3_next",
        "kimi_linear",
    }  # fmt: skip
    rows = {name: (config, model) for name, config, model, *_ in families._ROWS}
    assert wanted <= set(rows)
    for name in families.MISSING:
        config, model = rows[name]
        assert getattr(transformers, config, None) is None or getattr(transformers, model, None) is None


def test_gpt_oss_runs_padded_eager_and_says_why(checkpoints, caplog):
    with caplog.at_level("WARNING", logger="dflash_pipe.target"):
        core = TargetCore(checkpoints["gpt_oss"], (0, 1), "cpu", torch.float32)
    assert core.packing == "padded" and core.plan.attn_implementation == "eager"
    lines = [r.getMessage() for r in caplog.records if "packed rows are not exact" in r.getMessage()]
    assert len(lines) == 1 and "position ids" in lines[0]
    with pytest.raises(ValueError, match='needs packing="packed"'):
        TargetCore(checkpoints["gpt_oss"], (0, 1), "cpu", torch.float32, attention="flex")


def test_a_leaking_packed_target_falls_back_to_padded_rows(checkpoints, batch, monkeypatch, caplog):
    """The probe, not the family table or the layer rules: gpt-oss's packed rows leak, so without its table
    entry, and with no layer rule objecting, the probe must catch that, say so once, and run padded rows."""
    from dflash_pipe.target import core as core_module
    from dflash_pipe.target import families
    from dflash_pipe.target.hybrid import HybridPlan

    monkeypatch.setattr(families, "PADDED_FAMILIES", {})
    monkeypatch.setattr(core_module, "inspect_layers", lambda *_: HybridPlan(mixers=(), unproven=None))
    with caplog.at_level("WARNING", logger="dflash_pipe.target"):
        core = TargetCore(checkpoints["gpt_oss"], LAYER_IDS, "cpu", torch.float32)
    assert core.packing == "padded"
    lines = [r.getMessage() for r in caplog.records if "leak into each other" in r.getMessage()]
    assert len(lines) == 1 and "gpt_oss" in lines[0]
    errors = relative_errors(
        core.features(batch, LENGTHS), reference("gpt_oss", checkpoints["gpt_oss"], batch)
    )
    assert max(errors) <= TOLERANCE


def test_a_non_causal_model_is_refused(tmp_path):
    """BERT has a causal-LM head class in transformers but attends both ways: refused, naming why."""
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertLMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedTargetError, match="not a causal LM"):
        TargetCore(tmp_path, (0,), "cpu", torch.float32)


def test_an_encoder_decoder_and_a_vision_model_are_refused_from_their_config():
    from dflash_pipe.target.families import plan_target

    t5 = transformers.T5Config(vocab_size=VOCAB, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    with pytest.raises(UnsupportedTargetError, match="'t5' is an encoder-decoder"):
        plan_target(t5)
    with pytest.raises(UnsupportedTargetError, match="'vit' has no causal-LM class"):
        plan_target(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))


@pytest.mark.parametrize(
    ("row", "decoder"), [("kimi_k25", "DeepseekV3Model"), ("gemma3-multimodal", "Gemma3TextModel")]
)
def test_a_multimodal_wrapper_keeps_only_its_language_model(row, decoder, checkpoints, batch):
    """Kimi-K2.5 has no causal-LM class (its checkpoint loads through its multimodal wrapper, with
    transformers' own weight renames); Gemma 3's causal LM is its wrapper. Either way the vision tower and
    projector are freed, and the features and the greedy next tokens (the LM head, tied to the embedding)
    come from the text model inside, as the full wrapper computes them."""
    core = TargetCore(checkpoints[row], (0, 3), "cpu", torch.float32)
    assert type(core.model).__name__ == FAMILIES[row].model_class
    assert type(core.decoder).__name__ == decoder
    assert core.hidden_size == 32 and core.num_layers == LAYERS
    kept = sum(p.numel() for p in core.model.parameters())
    assert kept == sum(p.numel() for p in core.decoder.parameters())  # tied head: nothing else is left
    full_class = getattr(transformers, FAMILIES[row].model_class)
    full = full_class.from_pretrained(checkpoints[row], dtype=torch.float32).eval()
    assert sum(p.numel() for p in full.parameters()) > kept
    with torch.no_grad():
        want = [full(input_ids=s[None]).logits[0].argmax(-1) for s in batch.split(LENGTHS)]
    assert torch.equal(core.greedy_next(batch, LENGTHS), torch.cat(want))


def test_kernel_noise_is_not_read_as_a_leak(checkpoints):
    """GPU kernels with atomics differ run to run; the probe measures that noise on a repeated input, so a
    target whose features wobble by 1e-3 on every call is neither refused nor moved to padded rows."""
    from dflash_pipe.target.families import check_loaded

    core = TargetCore(checkpoints["qwen3"], LAYER_IDS, "cpu", torch.float32)
    exact = core.features
    gen = torch.Generator().manual_seed(1)

    def noisy(ids, lengths):
        out = exact(ids, lengths)
        return out * (1 + 1e-3 * torch.randn(out.shape, generator=gen))

    core.features = noisy
    check_loaded(core)
    assert core.packing == "packed"
