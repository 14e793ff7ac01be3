"""``RunDir``: the paths a run dir's parts live at, the run a checkpoint belongs to, the launch's checks and
the saved config (read from the path given, its input paths written absolute)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dflash_pipe.commands.launch_config import build_run_config
from dflash_pipe.run import files
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.files import RunDirError


def test_every_path_is_under_the_root_and_named_once(tmp_path: Path):
    run = RunDir(tmp_path)
    paths = [
        run.config, run.metrics, run.tensorboard, run.logs, run.compile_cache, run.samples, run.regenerated,
        run.report, run.export, run.record, run.owner, run.checkpoints,
    ]  # fmt: skip
    assert all(p.parent == tmp_path for p in paths) and len({p.name for p in paths}) == len(paths)
    assert {p.name for p in paths} <= set(files.NAMES)
    assert run.checkpoint(12) == tmp_path / files.CHECKPOINTS_DIR / "step-00000012"
    assert run.latest.parent == run.checkpoints
    assert run.worker_log("worker3") == run.logs / "worker3.log"
    attached = run.attached("node1")
    assert attached.root.parent.parent == tmp_path and attached.metrics.parent == attached.root


def test_the_run_of_a_checkpoint(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    assert RunDir.of_checkpoint(run.checkpoint(4)) == run
    assert RunDir.of_checkpoint(tmp_path / "loose" / "step-00000004") is None


def test_a_fresh_run_never_lands_on_one_with_checkpoints_and_a_resume_needs_a_run(tmp_path: Path):
    run = RunDir(tmp_path)
    run.check(resume=False)  # empty: fine
    with pytest.raises(RunDirError, match=f"--resume {tmp_path}: no config.json there"):
        run.check(resume=True)
    cfg, _ = build_run_config({"run_dir": tmp_path, "device": "cpu"})
    run.save_config(cfg)
    run.check(resume=True)
    run.check(resume=False)  # a config alone (a launch stopped before its first checkpoint) is started over
    run.checkpoints.mkdir()
    with pytest.raises(RunDirError, match="already holds a run with checkpoints. Continue it with"):
        run.check(resume=False)


def test_the_saved_config_has_absolute_input_paths_and_loads_as_the_path_given(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("")
    cfg, _ = build_run_config({"run_dir": Path("run"), "device": "cpu", "data_path": Path("d.jsonl")})
    RunDir(cfg.run_dir).save_config(cfg)
    saved = json.loads((tmp_path / "run" / files.CONFIG_FILE).read_text())
    assert saved["data"]["path"] == str(tmp_path / "d.jsonl") and saved["run_dir"] == "run"
    os.replace(tmp_path / "run", tmp_path / "moved")
    back = RunDir(tmp_path / "moved").load_config()
    assert back.run_dir == tmp_path / "moved" and back.data.path == tmp_path / "d.jsonl"
