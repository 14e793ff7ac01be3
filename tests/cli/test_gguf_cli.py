"""What the commands that take a target say about a GGUF target or a mask token that cannot work: one line
naming the input and the fix, a non-zero exit, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_pipe.cli import main
from dflash_pipe.data import demo_data_path
from tests.target.gguf_files import write_tiny_gguf

pytest.importorskip("gguf")
pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_PIPE_CACHE", str(tmp_path_factory.getbasetemp() / "dflash-cache"))


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def last_line(result) -> str:
    assert result.exit_code not in (0, None) and "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return [line for line in result.output.splitlines() if line.strip()][-1]


def launch(tmp_path: Path, *args: str):
    data = ("--data", str(demo_data_path()), "--responses", "dataset", "--draft-layers", "1")
    return run("launch", "--plain", "--device", "cpu", *data, "--run-dir", str(tmp_path / "r"), *args)


def test_launch_with_a_missing_gguf_file(tmp_path: Path):
    line = last_line(launch(tmp_path, "--target-model", str(tmp_path / "model.gguf")))
    assert line == (
        f"error: --target-model {tmp_path / 'model.gguf'}: no such file. Pass a GGUF file or a Hugging Face "
        "model directory (config.json + safetensors + tokenizer)"
    )


def test_launch_with_a_folder_without_config(tmp_path: Path):
    line = last_line(launch(tmp_path, "--target-model", str(tmp_path)))
    assert line.startswith(f"error: --target-model {tmp_path}: no config.json there") and "GGUF" in line


def test_launch_on_a_gguf_whose_tokenizer_has_no_mask_token(tmp_path: Path):
    target = write_tiny_gguf(tmp_path / "plain.gguf", code_specials=False)
    result = launch(tmp_path, "--target-model", str(target))
    line = last_line(result)
    assert line.startswith("error: mask token: the tokenizer has no mask, reserved or unused special token")
    assert "pass --mask-token-id" in line and str(target.stem) in line
    assert "converting it once" in result.output and not (tmp_path / "r" / "logs").exists()


def test_launch_with_a_mask_token_the_data_uses(tmp_path: Path):
    target = write_tiny_gguf(tmp_path / "smol.gguf")
    data = tmp_path / "c.jsonl"
    rows = [
        [{"role": "user", "content": f"hi {i} <gh_stars>"}, {"role": "assistant", "content": "ok"}]
        for i in range(12)
    ]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    result = run(
        "launch", "--plain", "--device", "cpu", "--data", str(data), "--responses", "dataset",
        "--draft-layers", "1", "--run-dir", str(tmp_path / "r"), "--target-model", str(target),
        "--mask-token-id", "7", "--max-length", "128",
    )  # fmt: skip
    line = last_line(result)
    assert line.startswith("error: --mask-token-id 7: token 7 ('<gh_stars>') appears in the training data")
    assert not (tmp_path / "r" / "logs").exists()


def test_launch_dry_run_shows_the_gguf_target(tmp_path: Path):
    target = write_tiny_gguf(tmp_path / "smol.gguf")
    result = launch(tmp_path, "--target-model", str(target), "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"{target} (GGUF, converted once, on first use, to " in result.output


def test_regenerate_with_a_missing_gguf_file(tmp_path: Path):
    result = run(
        "regenerate", "--target-model", str(tmp_path / "m.gguf"), "--data", str(demo_data_path()),
        "--out", str(tmp_path / "o.jsonl"), "--device", "cpu",
    )  # fmt: skip
    assert last_line(result).startswith(f"error: --target-model {tmp_path / 'm.gguf'}: no such file")


def test_eval_with_a_gguf_transformers_cannot_load(tmp_path: Path):
    odd = write_tiny_gguf(tmp_path / "odd.gguf", architecture="notallama", quantize=False)
    (tmp_path / "export").mkdir()
    result = run(
        "eval", "--target-model", str(odd), "--drafter", str(tmp_path / "export"),
        "--data", str(demo_data_path()), "--device", "cpu",
    )  # fmt: skip
    line = last_line(result)
    assert line.startswith(f"Error: --target-model {odd}: transformers") and "notallama" in line


def test_serve_command_with_a_missing_gguf_target(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = run("serve-command", str(tmp_path), "--target", str(tmp_path / "t.gguf"))
    assert f"--target {tmp_path / 't.gguf'}: no such file" in last_line(result)
