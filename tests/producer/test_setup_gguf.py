"""A run on a GGUF target: set up from its converted folder (recorded beside the file), with a MASK token
the data never contains: an automatic choice the data uses moves on, a --mask-token-id it uses is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_pipe.config.mask_token import MASK_TOKEN_KEY
from dflash_pipe.data import DataConfig
from dflash_pipe.producer.setup import GGUF_KEY, OptionsError, SetupError, prepare_run
from dflash_pipe.run.config import DrafterOptions, RunConfig
from dflash_pipe.run.layout import LayoutConfig
from tests.target.gguf_files import write_tiny_gguf

pytest.importorskip("gguf")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def smol_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "smol.gguf")


@pytest.fixture(autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_PIPE_CACHE", str(tmp_path_factory.getbasetemp() / "dflash-cache"))


def chat_file(path: Path, *, special: str | None = None) -> Path:
    """20 short conversations; with ``special``, one of them mentions that special token's text (which
    the tokenizer turns into the special token)."""
    lines = []
    for i in range(20):
        user = f"say {i} twice" + (f" {special}" if special and i == 3 else "")
        lines.append(
            {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"{i} {i}"}]}
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def config(run_dir: Path, target: Path, data: Path, **drafter) -> RunConfig:
    return RunConfig(
        run_dir=run_dir,
        target_model=target,
        data=DataConfig(path=data, max_length=128, min_loss_tokens=1),
        drafter=DrafterOptions(num_layers=1, **drafter),
        layout=LayoutConfig(device="cpu"),
        eval_samples=0,
    )


def test_a_gguf_target_runs_from_its_folder_and_records_both(tmp_path: Path, smol_gguf: Path):
    ctx = prepare_run(
        config(tmp_path / "r", smol_gguf, chat_file(tmp_path / "c.jsonl")), resume=False, progress=False
    )
    assert (ctx.target_path / "config.json").is_file() and ctx.target_path.parent.name == "gguf"
    assert ctx.drafter.extra[GGUF_KEY] == {"file": str(smol_gguf.resolve()), "folder": str(ctx.target_path)}
    assert ctx.drafter.mask_token_id == 16 and ctx.drafter.extra[MASK_TOKEN_KEY]["text"] == "<empty_output>"
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["target_model"] == str(smol_gguf.resolve())  # the user's file: a resume converts it again


def test_an_automatic_mask_token_the_data_uses_moves_to_the_next(tmp_path: Path, smol_gguf: Path):
    data = chat_file(tmp_path / "c.jsonl", special="<empty_output>")
    ctx = prepare_run(config(tmp_path / "r", smol_gguf, data), resume=False, progress=False)
    assert any(16 in s.input_ids.tolist() for s in ctx.train_samples)  # the data does hold it
    assert ctx.drafter.mask_token_id == 15
    recorded = ctx.drafter.extra[MASK_TOKEN_KEY]
    assert (
        recorded["text"] == "<jupyter_script>" and "16 ('<empty_output>') is in the data" in recorded["why"]
    )


def test_a_given_mask_token_the_data_uses_is_refused(tmp_path: Path, smol_gguf: Path):
    data = chat_file(tmp_path / "c.jsonl", special="<filename>")
    with pytest.raises(OptionsError) as info:
        prepare_run(config(tmp_path / "r", smol_gguf, data, mask_token_id=6), resume=False, progress=False)
    text = str(info.value)
    assert "\n" not in text and text.startswith(
        "--mask-token-id 6: token 6 ('<filename>') appears in the training"
    )
    assert str(data) in text and "leave the flag out" in text
    ctx = prepare_run(config(tmp_path / "r2", smol_gguf, data, mask_token_id=7), resume=False, progress=False)
    assert ctx.drafter.mask_token_id == 7


def test_a_missing_gguf_file_is_a_setup_error(tmp_path: Path):
    with pytest.raises(SetupError, match=r"--target-model .*nope\.gguf: no such file"):
        prepare_run(
            config(tmp_path / "r", tmp_path / "nope.gguf", chat_file(tmp_path / "c.jsonl")), resume=False
        )
