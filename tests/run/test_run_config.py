from pathlib import Path

import pytest

from dflash_pipe.commands.launch_config import build_run_config
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.data import DataConfig
from dflash_pipe.run.config import DrafterOptions, RunConfig, WireConfig
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.layout import LayoutConfig


def test_round_trip_through_json(tmp_path: Path):
    cfg = RunConfig(
        run_dir=tmp_path / "run",
        data=DataConfig(path=tmp_path / "d.jsonl", token_budget=1234),
        drafter=DrafterOptions(num_layers=3, target_layer_ids=(1, 4, 7)),
        train=TrainConfig(max_steps=9, betas=(0.8, 0.9)),
        layout=LayoutConfig(device="cpu", cpu_workers=3),
    )
    RunDir(cfg.run_dir).save_config(cfg)
    back = RunDir(cfg.run_dir).load_config()
    assert back.to_dict() == cfg.to_dict()
    assert back.drafter.target_layer_ids == (1, 4, 7) and back.train.betas == (0.8, 0.9)
    assert back.cache_dir == tmp_path / "run" / "compile-cache"


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"Unknown train config key\(s\) \['lr_max'\]"):
        RunConfig.from_dict({"run_dir": "x", "data": {"path": "d"}, "train": {"lr_max": 1}})


def test_cli_options_build_a_demo_config_on_cpu(tmp_path: Path):
    cfg, resume = build_run_config({"run_dir": tmp_path, "device": "cpu", "workers": 3, "max_steps": 5})
    assert not resume and cfg.target_model is None
    assert cfg.layout.num_workers == 3 and cfg.train.max_steps == 5
    assert cfg.drafter.num_layers == 3 and cfg.train.epochs == 1  # demo defaults
    with pytest.raises(ValueError, match="--data .*is needed"):
        build_run_config({"run_dir": tmp_path, "target_model": tmp_path, "device": "cpu"})


def test_resume_refuses_flags_that_cannot_change(tmp_path: Path):
    cfg, _ = build_run_config({"run_dir": tmp_path, "device": "cpu"})
    RunDir(tmp_path).save_config(cfg)
    with pytest.raises(ValueError, match="--lr cannot change on resume"):
        build_run_config({"resume_dir": tmp_path, "lr": 1e-3})
    resumed, resume = build_run_config({"resume_dir": tmp_path, "max_steps": 50})
    assert resume and resumed.train.max_steps == 50


def test_reconnect_timeout_reaches_the_launched_workers(tmp_path: Path):
    from dflash_pipe.worker_pool import WorkerPool

    cfg, _ = build_run_config({"run_dir": tmp_path, "device": "cpu", "reconnect_timeout": 42.0})
    assert cfg.wire.reconnect_timeout_s == 42.0
    RunDir(tmp_path).save_config(cfg)
    resumed, _ = build_run_config({"resume_dir": tmp_path, "reconnect_timeout": 7.0})
    assert resumed.wire.reconnect_timeout_s == 7.0
    with pytest.raises(ValueError, match="reconnect_timeout_s"):
        build_run_config({"run_dir": tmp_path / "x", "device": "cpu", "reconnect_timeout": -1.0})
    cmd = WorkerPool(cfg, "tcp://127.0.0.1:5555").worker_command("worker0", "cpu")
    assert cmd[cmd.index("--reconnect-timeout") + 1] == "42.0"
    assert cmd[cmd.index("--connect") + 1] == "tcp://127.0.0.1:5555"


def test_cuda_ipc_payload_path_needs_cuda(tmp_path: Path):
    from dflash_pipe.run.config import WireConfig

    data = DataConfig(path=tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="cuda_ipc needs the target and the drafters on CUDA"):
        RunConfig(
            run_dir=tmp_path,
            data=data,
            wire=WireConfig(payload_path="cuda_ipc"),
            layout=LayoutConfig(device="cpu"),
        )
    cfg = RunConfig(
        run_dir=tmp_path,
        data=data,
        wire=WireConfig(payload_path="cuda_ipc"),
        layout=LayoutConfig(device="cuda", target_gpus=(0,), drafter_gpus=(0,)),
    )
    assert cfg.wire.payload_path == "cuda_ipc"
    with pytest.raises(ValueError, match="auto, socket, shm or cuda_ipc"):
        WireConfig(payload_path="gpu")


def test_tokenize_workers_flag_including_zero(tmp_path: Path):
    """--tokenize-workers N sets data.tokenize_workers; a typed 0 is a value (0 == False must not drop it),
    and it may change on --resume (it does not change the samples)."""
    cfg, _ = build_run_config({"run_dir": tmp_path, "device": "cpu"})
    assert cfg.data.tokenize_workers is None
    cfg, _ = build_run_config({"run_dir": tmp_path, "device": "cpu", "tokenize_workers": 0})
    assert cfg.data.tokenize_workers == 0
    RunDir(tmp_path).save_config(cfg)
    resumed, _ = build_run_config({"resume_dir": tmp_path, "tokenize_workers": 4})
    assert resumed.data.tokenize_workers == 4
    with pytest.raises(ValueError, match="DataConfig.tokenize_workers must be >= 0"):
        build_run_config({"run_dir": tmp_path / "x", "device": "cpu", "tokenize_workers": -2})


def test_building_a_run_config_does_not_load_zmq(tmp_path: Path):
    """The config checks addresses with the wire's address policy, not its sockets: a fresh interpreter
    that builds and validates a RunConfig (a keyless loopback bind, a refused public one) has no zmq."""
    import subprocess
    import sys

    code = f"""
import sys
from dflash_pipe.run.config import RunConfig, WireConfig
from dflash_pipe.data import DataConfig
from dflash_pipe.run.layout import LayoutConfig
RunConfig(run_dir={str(tmp_path)!r}, data=DataConfig(path="d.jsonl"), layout=LayoutConfig(device="cpu"),
          wire=WireConfig(bind="tcp://127.0.0.1:5555"))
try:
    WireConfig(bind="tcp://0.0.0.0:5555")
except ValueError as e:
    assert "without CURVE keys" in str(e), e
else:
    raise AssertionError("a public bind without keys was accepted")
print(sorted(m for m in sys.modules if m == "zmq" or m.startswith("zmq.")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_resume_on_other_devices_validates_the_whole_config(tmp_path: Path):
    """A run saved with cuda_ipc on CUDA, resumed with --device cpu: the new layout is checked with the rest
    of the config (it used to replace cfg.layout after validation, so cuda_ipc-needs-CUDA was skipped)."""
    cfg = RunConfig(
        run_dir=tmp_path,
        data=DataConfig(path=tmp_path / "d.jsonl"),
        layout=LayoutConfig(device="cuda", target_gpus=(0,), drafter_gpus=(1,)),
        wire=WireConfig(payload_path="cuda_ipc"),
    )
    RunDir(tmp_path).save_config(cfg)
    with pytest.raises(ValueError, match="cuda_ipc needs the target and the drafters on CUDA"):
        build_run_config({"resume_dir": tmp_path, "device": "cpu", "workers": 2})
    resumed, _ = build_run_config({"resume_dir": tmp_path, "drafter_gpus": "1-2"})
    assert resumed.layout.drafter_gpus == (1, 2) and resumed.layout.target_gpus == (0,)
    assert resumed.wire.payload_path == "cuda_ipc"


def test_the_dry_run_shows_the_command_launch_runs_for_each_worker(tmp_path: Path):
    """`launch --dry-run` used to print worker commands without --keys and --reconnect-timeout."""
    import shlex

    from dflash_pipe.commands.launch_config import plan_text
    from dflash_pipe.worker_pool import WorkerPool

    keys = tmp_path / "keys"
    cfg, _ = build_run_config({"run_dir": tmp_path, "device": "cpu", "reconnect_timeout": 42.0, "keys": keys})
    plan = plan_text(cfg, resume=False)
    for i in range(cfg.layout.num_workers):
        launched = WorkerPool(cfg, "<producer address>").worker_command(f"worker{i}", "cpu")
        assert shlex.join(["python", *launched[1:]]) in plan
    assert "--reconnect-timeout 42.0" in plan and f"--keys {keys}" in plan
