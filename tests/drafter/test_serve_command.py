"""`serve-command` (and the end of `export`): each printed command's flags are what the engine stand-ins
(engine_loaders.py, written from vLLM's, SGLang's and the reference's loaders) read from the same tiny
export; the chat template arguments the run trained with are recorded in the export and shown."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import Qwen3Config

from dflash_pipe.cli import main
from dflash_pipe.data import DataConfig, demo_data_path
from dflash_pipe.drafter.export import export_drafter
from dflash_pipe.drafter.serve import TARGET_PLACEHOLDER, plan_from_path, serve_command
from dflash_pipe.run.checkpoint import save_checkpoint
from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.run.ledger import Ledger

from .conftest import tiny_config, tiny_drafter
from .engine_loaders import SLIDING, reference_loads, sglang_loads, vllm_loads

DRAFTERS = {
    "full": dict(num_hidden_layers=2),
    "mixed": dict(num_hidden_layers=3, layer_types=(SLIDING, SLIDING, "full_attention"), sliding_window=6),
    "bs10": dict(num_hidden_layers=2, block_size=10, target_layer_ids=(0, 1)),
}
TARGET = "/models/Qwen3-8B"


@pytest.fixture(params=list(DRAFTERS))
def exported(request, tmp_path):
    model = tiny_drafter(tiny_config(attention_backend="sdpa", **DRAFTERS[request.param]))
    out = tmp_path / "export dir"  # a space: the paths must come out shell-quoted
    export_drafter(model, out, dtype=torch.bfloat16)
    raw = json.loads((out / "config.json").read_text())
    hf = Qwen3Config.from_pretrained(str(out))  # how the engines get the config
    return model, out, raw, hf, load_file(str(out / "model.safetensors"))


def _argv(text: str) -> list[str]:
    """The command's words (the comment lines and line continuations left out)."""
    command = " ".join(line.rstrip("\\") for line in text.splitlines() if line and not line.startswith("#"))
    return shlex.split(command)


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def test_vllm_command_gives_what_vllm_reads(exported) -> None:
    model, out, raw, hf, tensors = exported
    text = serve_command(plan_from_path(out, target=TARGET), "vllm")
    argv = _argv(text)
    got = vllm_loads(raw, hf, tensors)
    env = [w for w in argv if "=" in w and not w.startswith("-") and argv.index(w) < argv.index("vllm")]
    assert env == (["VLLM_USE_V2_MODEL_RUNNER=1"] if got["needs_v2_runner"] else [])
    assert argv[len(env) : len(env) + 3] == ["vllm", "serve", TARGET]
    spec = json.loads(_flag(argv, "--speculative-config"))
    assert spec == {"method": "dflash", "model": str(out), "num_speculative_tokens": got["block_size"] - 1}
    assert ("V2 model runner" in text) == got["needs_v2_runner"]
    assert "--default-chat-template-kwargs" not in argv  # an export of a model in memory records none
    assert "not recorded" in text


def test_sglang_command_gives_what_sglang_reads(exported) -> None:
    _, out, raw, hf, tensors = exported
    argv = _argv(serve_command(plan_from_path(out, target=TARGET), "sglang"))
    got = sglang_loads(raw, hf, tensors)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"] and _flag(argv, "--model-path") == TARGET
    assert _flag(argv, "--speculative-algorithm") == "DFLASH"
    assert _flag(argv, "--speculative-draft-model-path") == str(out)
    assert int(_flag(argv, "--speculative-num-draft-tokens")) == got["block_size"]


def test_reference_snippet_loads_the_export_the_reference_reads(exported) -> None:
    model, out, _, hf, _ = exported
    text = serve_command(plan_from_path(out, target=TARGET), "reference")
    compile(text, "snippet", "exec")  # valid Python as printed
    assert f"DFlashDraftModel.from_pretrained({str(out)!r}" in text and "draft.spec_generate(" in text
    got = reference_loads(hf)
    assert f"block_size {got['block_size']}" in text and got["block_size"] == model.cfg.block_size


def test_an_export_without_a_target_says_how_to_name_it(tmp_path) -> None:
    export_drafter(tiny_drafter(), tmp_path)
    text = serve_command(plan_from_path(tmp_path), "vllm")
    assert _argv(text)[2] == TARGET_PLACEHOLDER and "pass --target" in text


def _run_dir(tmp_path: Path, template_kwargs: dict) -> Path:
    """A run dir with one checkpoint (1 step) and a config.json recording the chat template arguments."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = DataConfig(path=demo_data_path(), max_length=64, chat_template_kwargs=template_kwargs)
    cfg = RunConfig(run_dir=run_dir, target_model=Path(TARGET), data=data, layout=LayoutConfig(device="cpu"))
    RunDir(run_dir).save_config(cfg)
    model = tiny_drafter(tiny_config(block_size=8))
    ledger = Ledger(4, 1)
    ledger.mark(0, [0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(
        run_dir,
        step=1,
        model=model,
        drafter_config=model.cfg.to_dict(),
        optimizer=opt,
        ledger=ledger.to_dict(),
    )
    return run_dir


def test_a_run_dir_gives_its_target_its_template_arguments_and_the_export_step(tmp_path) -> None:
    run_dir = _run_dir(tmp_path, {"enable_thinking": False})
    text = serve_command(plan_from_path(run_dir), "vllm")
    assert text.startswith(f"# first: dflash-pipe export {run_dir} {run_dir / 'export'}\n")
    argv = _argv(text)
    assert argv[:3] == ["vllm", "serve", TARGET]
    assert json.loads(_flag(argv, "--speculative-config"))["num_speculative_tokens"] == 7
    assert json.loads(_flag(argv, "--default-chat-template-kwargs")) == {"enable_thinking": False}
    sglang = serve_command(plan_from_path(run_dir), "sglang")
    assert '"chat_template_kwargs": {"enable_thinking": false}' in sglang
    assert "enable_thinking=False" in serve_command(plan_from_path(run_dir), "reference")


def test_export_records_the_template_arguments_and_prints_the_vllm_command(tmp_path) -> None:
    run_dir = _run_dir(tmp_path, {"enable_thinking": True})
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(run_dir), str(out)])
    assert result.exit_code == 0, result.output
    dflash = json.loads((out / "config.json").read_text())["dflash_config"]
    assert dflash["chat_template_kwargs"] == {"enable_thinking": True}
    tail = result.output[result.output.index("vllm serve") :]
    argv = _argv(tail)
    assert argv[:3] == ["vllm", "serve", TARGET] and json.loads(_flag(argv, "--speculative-config"))[
        "model"
    ] == str(out)
    again = CliRunner().invoke(main, ["serve-command", str(out), "--engine", "sglang", "--target", TARGET])
    assert again.exit_code == 0, again.output
    assert _flag(_argv(again.output), "--speculative-num-draft-tokens") == "8"
    assert '"enable_thinking": true' in again.output


def test_serve_command_refuses_a_folder_that_is_neither(tmp_path) -> None:
    result = CliRunner().invoke(main, ["serve-command", str(tmp_path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "is not a checkpoint" in result.output
