"""`dflash-pipe eval` end to end on an exported drafter: real speculative decoding and the simulated mode."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from transformers import Qwen3ForCausalLM

from dflash_pipe.cli import main
from dflash_pipe.data import DataConfig, demo_data_path, demo_tokenizer, load_samples
from dflash_pipe.drafter import export_drafter, load_exported
from dflash_pipe.drafter.generate_eval import prompts_from_samples
from tests.tiny_models import export_random_drafter, save_demo_target
from tests.trained_drafter import train_on_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny random target over the demo tokenizer, saved as an HF dir, and a random drafter's export."""
    root = tmp_path_factory.mktemp("eval")
    target = save_demo_target(root / "target", tie_word_embeddings=True)
    export_random_drafter(target, root / "drafter")
    data = root / "eval.jsonl"
    data.write_text("".join(demo_data_path().read_text().splitlines(keepends=True)[:6]))
    return root, data


@pytest.fixture(scope="module")
def trained(exported):
    """The same drafter trained 40 steps on the target's greedy continuations of the eval prompts, exported
    next to the untrained one."""
    root, data = exported
    tok = demo_tokenizer()
    target = Qwen3ForCausalLM.from_pretrained(str(root / "target")).eval()
    drafter = load_exported(
        root / "drafter", embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings()
    )
    samples = load_samples(DataConfig(path=data, max_length=3072), tok).samples
    train_on_greedy(target, drafter, prompts_from_samples(samples, 3), new_tokens=16, steps=40)
    export_drafter(drafter, root / "trained")
    return root / "trained"


def run(root, data, *args, drafter=None):
    drafter = drafter or root / "drafter"
    base = ["eval", "--target-model", str(root / "target"), "--drafter", str(drafter)]
    return CliRunner().invoke(main, [*base, "--data", str(data), "--device", "cpu", *args])


def test_generate_mode_is_real_and_lossless(exported, tmp_path) -> None:
    root, data = exported
    out = tmp_path / "real.json"
    result = run(root, data, "--max-samples", "3", "--max-new-tokens", "12", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "real acceptance" in result.output and "lossless" in result.output
    record = json.loads(out.read_text())
    m = record["metrics"]
    assert record["mode"] == "generate" and m["real/prompts"] == 3 and m["real/lossless_mismatches"] == 0
    assert 1.0 <= m["real/tau"] <= 4 and m["real/new_tokens"] <= 3 * 12
    assert m["real/tau_pooled"] == pytest.approx(1 + sum(m["real/acceptance_per_position"]))
    assert record["provenance"]["versions"]["transformers"]


def test_a_trained_drafter_beats_the_untrained_one(exported, trained, tmp_path) -> None:
    """The tau the command reports tells drafters apart: the trained export's is well above the untrained's."""
    root, data = exported
    taus = {}
    for name, drafter in (("untrained", root / "drafter"), ("trained", trained)):
        out = tmp_path / f"{name}.json"
        args = ("--max-samples", "3", "--max-new-tokens", "12", "--out", str(out))
        result = run(root, data, *args, drafter=drafter)
        assert result.exit_code == 0, result.output
        metrics = json.loads(out.read_text())["metrics"]
        assert metrics["real/lossless_mismatches"] == 0
        taus[name] = metrics["real/tau"]
    assert taus["trained"] > taus["untrained"] + 1.0, taus


def test_dtype_bfloat16_runs_the_pair_in_bf16_and_says_so(exported, tmp_path) -> None:
    """--dtype picks the precision of the target and the drafter; the record names it. On the CPU bf16 is
    slow but runs, and the decoding stays real (tokens, a tau) whatever the near-ties do."""
    root, data = exported
    out = tmp_path / "bf16.json"
    result = run(
        root, data, "--max-samples", "2", "--max-new-tokens", "8", "--dtype", "bfloat16", "--out", str(out)
    )
    record = json.loads(out.read_text())
    assert result.exit_code in (0, 1), result.output  # 1: a near-tie flipped (the reason float32 exists)
    assert record["dtype"] == "bfloat16" and record["metrics"]["real/new_tokens"] > 0
    assert record["metrics"]["real/tau"] >= 1.0


def test_generate_mode_fails_loudly_when_not_lossless(exported, monkeypatch, tmp_path) -> None:
    from dflash_pipe.drafter import speculate

    monkeypatch.setattr(speculate, "accepted_length", lambda draft, greedy: len(draft))
    root, data = exported
    out = tmp_path / "bad.json"
    result = run(root, data, "--max-samples", "2", "--max-new-tokens", "12", "--out", str(out))
    assert result.exit_code == 1 and "2 of 2 prompts" in result.output and "not lossless" in result.output
    assert json.loads(out.read_text())["metrics"]["real/lossless_mismatches"] == 2  # recorded, then failed


def test_simulated_mode_and_bad_flags(exported) -> None:
    root, data = exported
    result = run(root, data, "--mode", "simulated", "--max-samples", "3")
    assert result.exit_code == 0, result.output
    assert "simulated acceptance" in result.output
    bad = run(root, data, "--max-new-tokens", "0")
    assert bad.exit_code == 2 and "--max-new-tokens must be >= 1" in bad.output


def _copy_export(root, tmp_path):
    """A copy of the shared export, to damage without touching the other tests'."""
    import shutil

    shutil.copytree(root / "drafter", tmp_path / "drafter")
    shutil.copytree(root / "target", tmp_path / "target", symlinks=True)
    return tmp_path


def _flip_weight_byte(path) -> None:
    import struct

    data = bytearray(path.read_bytes())
    data[8 + struct.unpack("<Q", data[:8])[0] + 5] ^= 0x10  # tensor data, past the safetensors header
    path.write_bytes(bytes(data))


def _one_error_line(result) -> str:
    """The refusal: exit status 1 and one line of output, no traceback."""
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize("mode", ["generate", "simulated"])
def test_eval_refuses_an_export_with_a_flipped_weight_byte(exported, tmp_path, mode) -> None:
    root, data = exported
    copy = _copy_export(root, tmp_path)
    _flip_weight_byte(copy / "drafter" / "model.safetensors")
    line = _one_error_line(run(copy, data, "--mode", mode, "--max-samples", "1", "--max-new-tokens", "4"))
    assert f"{copy / 'drafter' / 'model.safetensors'} does not match its sha256 in manifest.json" in line
    assert f"dflash-pipe export RUN_DIR {copy / 'drafter'}" in line and "tau" not in line


def test_eval_refuses_a_damaged_header_without_a_manifest_in_one_line(exported, tmp_path) -> None:
    root, data = exported
    copy = _copy_export(root, tmp_path)
    (copy / "drafter" / "manifest.json").unlink()  # an export older than manifests
    weights = copy / "drafter" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[12] ^= 0xFF
    weights.write_bytes(bytes(raw))
    line = _one_error_line(run(copy, data, "--max-samples", "1", "--max-new-tokens", "4"))
    assert f"{weights} is not a readable safetensors file" in line and "dflash-pipe export RUN_DIR" in line


def test_eval_of_an_export_without_a_manifest_warns_once(exported, tmp_path) -> None:
    root, data = exported
    copy = _copy_export(root, tmp_path)
    (copy / "drafter" / "manifest.json").unlink()
    result = run(copy, data, "--mode", "simulated", "--max-samples", "2")
    assert result.exit_code == 0, result.output
    assert result.output.count("has no manifest.json") == 1, result.output
    assert "not verified" in result.output and "simulated acceptance" in result.output
