"""--config for every command: file < flag precedence, unknown keys named, values typed, YAML/TOML/JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dflash_pipe.cli import main


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def printed_config(*args: str) -> dict:
    result = run("launch", "--print-config", *args)
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_file_values_apply_and_typed_flags_win(tmp_path: Path):
    cfg_file = write(
        tmp_path / "run.yaml",
        "run_dir: from-file\n"
        "train: {lr: 6e-4, max_steps: 7, epochs: 2}\n"  # YAML reads 6e-4 as a string: converted
        "data: {token_budget: 1000}\n"
        "layout: {device: cpu, cpu_workers: 3}\n",
    )
    cfg = printed_config("--config", str(cfg_file))
    assert cfg["run_dir"] == "from-file" and cfg["train"]["lr"] == 6e-4 and cfg["train"]["max_steps"] == 7
    assert cfg["data"]["token_budget"] == 1000 and cfg["layout"]["cpu_workers"] == 3
    assert cfg["drafter"]["num_layers"] == 3  # demo default where neither file nor flag says
    cfg = printed_config("--config", str(cfg_file), "--lr", "1e-3", "--max-steps", "9", "--workers", "1")
    assert cfg["train"]["lr"] == 1e-3 and cfg["train"]["max_steps"] == 9 and cfg["layout"]["cpu_workers"] == 1
    assert cfg["train"]["epochs"] == 2 and cfg["data"]["token_budget"] == 1000  # untouched by flags


def test_flag_defaults_do_not_override_the_file(tmp_path: Path):
    # --workers defaults to 2 and --device to auto: neither was typed, so the file's values stand.
    cfg_file = write(tmp_path / "run.yaml", "layout: {device: cpu, cpu_workers: 4}\n")
    cfg = printed_config("--config", str(cfg_file))
    assert cfg["layout"]["device"] == "cpu" and cfg["layout"]["cpu_workers"] == 4


def test_gpu_layout_from_a_file_needs_no_gpu(tmp_path: Path):
    cfg_file = write(
        tmp_path / "gpu.yaml", "layout: {device: cuda, target_gpus: 0-4, drafter_gpus: [5, 6, 7]}\n"
    )
    cfg = printed_config("--config", str(cfg_file))
    assert cfg["layout"]["target_gpus"] == [0, 1, 2, 3, 4] and cfg["layout"]["drafter_gpus"] == [5, 6, 7]
    cfg = printed_config("--config", str(cfg_file), "--drafter-gpus", "5,6")
    assert cfg["layout"]["drafter_gpus"] == [5, 6] and cfg["layout"]["target_gpus"] == [0, 1, 2, 3, 4]


def test_toml_and_json_files(tmp_path: Path):
    toml = write(tmp_path / "run.toml", 'log = ["jsonl"]\n[train]\nlr = 2e-4\n[layout]\ndevice = "cpu"\n')
    assert printed_config("--config", str(toml))["train"]["lr"] == 2e-4
    printed = printed_config("--config", str(toml), "--run-dir", str(tmp_path / "r"))
    as_json = write(tmp_path / "config.json", json.dumps(printed))  # a run dir's config.json works too
    assert printed_config("--config", str(as_json)) == printed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr: 1.0\n", "unknown key `lr`. Valid keys: compile_cache, data, drafter"),
        ("train: {lr_max: 1}\n", "unknown key `train.lr_max` in section `train`"),
        ("train: {lr_max: 1}\n", "Did you mean `train.lr`?"),
        ("target_gpus: 0-4\n", "`target_gpus` is a flag; in a config file it is `layout.target_gpus`"),
        ("train: {epochs: two}\n", "`train.epochs` must be an integer, got 'two'"),
        ("drafter: 5\n", "`drafter` must be a mapping of DrafterOptions fields"),
        ("log: [jsonl, nope]\n", "unknown metrics sink(s) ['nope']"),
    ],
)
def test_bad_keys_and_values_are_named(tmp_path: Path, text: str, message: str):
    result = run("launch", "--config", str(write(tmp_path / "bad.yaml", text)), "--dry-run")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_unparsable_file_names_the_file(tmp_path: Path):
    result = run("launch", "--config", str(write(tmp_path / "bad.yaml", "train: [1,\n")), "--dry-run")
    assert result.exit_code == 2 and "bad.yaml: not valid YAML" in result.output


def test_config_and_resume_do_not_mix(tmp_path: Path):
    cfg_file = write(tmp_path / "run.yaml", "train: {lr: 1.0e-3}\n")
    result = run("launch", "--config", str(cfg_file), "--resume", str(tmp_path), "--dry-run")
    assert result.exit_code == 2 and "--config and --resume do not mix" in result.output


def test_every_other_command_takes_a_flat_option_file(tmp_path: Path):
    for name, command in main.commands.items():
        if name == "launch":
            continue
        subcommands = command.commands.values() if hasattr(command, "commands") else [command]
        for sub in subcommands:
            assert any(p.name == "config_file" for p in sub.params), f"{name} {sub.name} lacks --config"
    worker = main.commands["worker"]
    cfg_file = write(tmp_path / "w.yaml", "connect: tcp://10.0.0.5:5555\ngpus: [6, 7]\njoin-timeout: 30\n")
    ctx = worker.make_context("worker", ["--config", str(cfg_file)])
    assert ctx.params["connect"] == "tcp://10.0.0.5:5555" and ctx.params["gpus"] == "6,7"
    assert ctx.params["join_timeout"] == 30.0
    ctx = worker.make_context("worker", ["--config", str(cfg_file), "--join-timeout", "5", "--gpus", "1"])
    assert ctx.params["join_timeout"] == 5.0 and ctx.params["gpus"] == "1"  # typed flags win


def test_unknown_key_in_an_option_file(tmp_path: Path):
    cfg_file = write(tmp_path / "w.yaml", "connect: tcp://h:1\njoin_timout: 3\n")
    result = run("worker", "--config", str(cfg_file))
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "unknown key `join_timout`" in text and "Did you mean `join_timeout`?" in text
    assert "Valid keys:" in text and "connect" in text


def test_report_reads_its_run_dir_from_a_file(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "time": 0, "loss": 2.0}\n')
    cfg_file = write(tmp_path / "r.yaml", f"run_dir: {run_dir}\nout: {tmp_path / 'png'}\n")
    result = run("report", "--config", str(cfg_file))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "png" / "loss.png").exists()


def test_every_launch_flag_sets_a_config_field():
    # A new launch flag must be mapped in commands.launch_config.FLAG_FIELDS, or it would be silently ignored.
    from dflash_pipe.commands.launch_config import FLAG_FIELDS

    # gpus: a probe turns it into layout.target_gpus / layout.drafter_gpus (commands/split.py)
    not_fields = {"resume_dir", "live", "config_file", "print_config", "dry_run", "gpus"}
    unmapped = [p.name for p in main.commands["launch"].params if p.name not in set(FLAG_FIELDS) | not_fields]
    assert not unmapped, f"add {unmapped} to FLAG_FIELDS in dflash_pipe/commands/launch_config.py"
