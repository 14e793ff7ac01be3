"""--drafter-mode: which worker processes the launcher starts, and the command each one runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_pipe.data import DataConfig
from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.worker_pool import WorkerPool


def test_processes_mode_is_one_process_per_device():
    lay = LayoutConfig(target_gpus=(0,), drafter_gpus=(1, 2, 3))
    assert lay.worker_processes() == [["cuda:1"], ["cuda:2"], ["cuda:3"]]


def test_threads_mode_is_one_process_for_all_devices():
    lay = LayoutConfig(target_gpus=(0,), drafter_gpus=(0, 1), drafter_mode="threads")
    assert lay.worker_processes() == [["cuda:0", "cuda:1"]]
    assert lay.num_workers == 2  # still two drafters
    cpu = LayoutConfig(device="cpu", cpu_workers=3, drafter_mode="threads")
    assert cpu.worker_processes() == [["cpu", "cpu", "cpu"]]


def test_threaded_worker_command(tmp_path: Path):
    cfg = RunConfig(
        run_dir=tmp_path,
        data=DataConfig(path=tmp_path / "d.jsonl"),
        layout=LayoutConfig(device="cpu", cpu_workers=2, drafter_mode="threads"),
    )
    cmd = WorkerPool(cfg, "tcp://127.0.0.1:5555").worker_command("worker0", "cpu,cpu")
    assert cmd[cmd.index("--device") + 1] == "cpu,cpu" and "--threads" in cmd


def test_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="--drafter-mode must be processes or threads"):
        LayoutConfig(device="cpu", drafter_mode="fibers")  # type: ignore[arg-type]
