"""A GGUF target becomes a plain HF folder once: the same logits as transformers' own GGUF loader, reused
from the cache, recorded, and every way it fails one line naming the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_pipe.target.gguf import (
    SOURCE_FILE,
    TargetPathError,
    converted_folder,
    gguf_source,
    resolve_target,
)
from tests.target.gguf_files import SPECIALS, vocabulary, write_tiny_gguf

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-smol.Q8_0.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    said: list[str] = []
    folder = resolve_target(tiny_gguf, say=said.append, root=tmp_path_factory.mktemp("cache"))
    return folder, said


def test_the_folder_gives_the_gguf_loaders_logits(tiny_gguf: Path, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, said = converted
    assert said == [f"GGUF target {tiny_gguf}: converting it once to a Hugging Face folder at {folder}"]
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    plain = AutoModelForCausalLM.from_pretrained(str(folder))
    assert plain.dtype == torch.float32 and getattr(plain, "hf_quantizer", None) is None
    ids = torch.tensor([[1, 40, 90, 200, 16, 2, 150]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, reference(ids).logits, rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    reference_tok = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "the rain <filename>"}], tokenize=False)
    assert text == reference_tok.apply_chat_template(
        [{"role": "user", "content": "the rain <filename>"}], tokenize=False
    )
    assert tokenizer(text)["input_ids"] == reference_tok(text)["input_ids"]
    assert len(tokenizer) == plain.config.vocab_size == len(vocabulary())


def test_the_folder_is_plain_and_says_where_it_came_from(tiny_gguf: Path, converted):
    folder, _ = converted
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == 100000.0  # transformers 4.x reads it here
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    assert (folder / "model.safetensors").is_file() and (folder / "generation_config.json").is_file()
    source = gguf_source(folder)
    assert source["gguf"] == str(tiny_gguf.resolve()) and source["dtype"] == "float32"
    assert source["size"] == tiny_gguf.stat().st_size
    assert folder == converted_folder(tiny_gguf, folder.parent)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_a_second_use_reuses_the_folder(tiny_gguf: Path, converted):
    folder, _ = converted
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    said: list[str] = []
    assert resolve_target(tiny_gguf, say=said.append, root=folder.parent) == folder
    assert said == [f"GGUF target {tiny_gguf}: using its converted folder {folder}"]
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_cache_is_under_DFLASH_PIPE_CACHE(tiny_gguf: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DFLASH_PIPE_CACHE", str(tmp_path))
    assert converted_folder(tiny_gguf).parent == tmp_path / "gguf"


def test_a_folder_stays_a_folder(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_target(tmp_path) == tmp_path and resolve_target(None) is None


def one_line(exc: pytest.ExceptionInfo, *needles: str) -> None:
    text = str(exc.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def test_a_missing_file_or_folder_is_one_line(tmp_path: Path):
    with pytest.raises(TargetPathError) as info:
        resolve_target(tmp_path / "nope.gguf", root=tmp_path)
    one_line(info, f"--target-model {tmp_path / 'nope.gguf'}: no such file", "GGUF file")
    with pytest.raises(TargetPathError) as info:
        resolve_target(tmp_path, flag="--target")
    one_line(info, f"--target {tmp_path}: no config.json there", "or a GGUF file")


def test_an_architecture_transformers_cannot_load_is_one_line(tmp_path: Path):
    odd = write_tiny_gguf(tmp_path / "odd.gguf", architecture="notallama", quantize=False)
    with pytest.raises(TargetPathError) as info:
        resolve_target(odd, root=tmp_path / "cache", say=None)
    one_line(
        info, f"--target-model {odd}: transformers", "notallama", "llama", "Hugging Face model directory"
    )
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".convert-lock")]


def test_a_file_that_is_no_gguf_is_one_line(tmp_path: Path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(TargetPathError) as info:
        resolve_target(junk, root=tmp_path / "cache", say=None)
    one_line(info, f"--target-model {junk}: transformers", "cannot load this GGUF file")


def test_without_the_packages_the_line_names_the_extra(tiny_gguf: Path, tmp_path: Path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(TargetPathError) as info:
        resolve_target(tiny_gguf, root=tmp_path)
    one_line(info, "needs the package(s) gguf", "pip install 'dflash-pipe[gguf]'")


def test_the_tiny_file_is_laid_out_like_smollm2():
    assert vocabulary()[: len(SPECIALS)] == list(SPECIALS) and SPECIALS[16] == "<empty_output>"
    assert SOURCE_FILE.endswith(".json")
