"""Targets and flags a launch refuses with one line (exit 2) before any work starts: no traceback, no worker."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from transformers import ViTConfig

from dflash_pipe.cli import main
from dflash_pipe.data import demo_data_path
from tests.target.families import FAMILIES


def launch(*args: str):
    return CliRunner().invoke(
        main, ["launch", "--plain", "--device", "cpu", "--data", str(demo_data_path()), *args]
    )


def test_a_shallow_target_under_default_flags_is_one_options_error(tmp_path: Path):
    target = FAMILIES["qwen3"].save_target(tmp_path / "target")  # 4 layers; 5 draft layers by default
    result = launch("--target-model", str(target), "--run-dir", str(tmp_path / "r"))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: --draft-layers 5: the target at"), result.output
    assert "--target-layer-ids" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r" / "logs").exists()  # no worker was started


def test_a_target_that_is_no_causal_lm_is_refused(tmp_path: Path):
    target = tmp_path / "vit"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(target)
    result = launch("--target-model", str(target), "--run-dir", str(tmp_path / "r"))
    assert result.exit_code == 2, result.output
    assert "error: --target-model" in result.output and "'vit' has no causal-LM class" in result.output
    assert not (tmp_path / "r" / "logs").exists()


def test_gpu_flags_with_device_cpu_are_one_error(tmp_path: Path):
    result = launch("--target-gpus", "0", "--drafter-gpus", "0", "--run-dir", str(tmp_path / "r"))
    assert result.exit_code == 2, result.output
    assert "GPUs cannot be used on the CPU" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r" / "logs").exists()


def test_gpu_flags_on_a_machine_without_cuda_are_refused_not_run_on_the_cpu():
    """What `--target-gpus 0 --drafter-gpus 0` meets where no GPU is visible (this CI machine)."""
    import pytest

    from dflash_pipe.run.layout import LayoutConfig

    layout = LayoutConfig(device="cuda", target_gpus=(0,), drafter_gpus=(1,))
    with pytest.raises(
        ValueError, match=r"--target-gpus 0 --drafter-gpus 1: no CUDA GPU is visible.*--device cpu"
    ):
        layout.validate_against(0)


def test_a_max_length_no_sample_fits_stops_before_regenerating(tmp_path: Path):
    """The demo regenerates its replies: with no prompt fitting under --max-length, the launch says so in one
    line and exits 2 before one conversation is generated or a worker started."""
    run_dir = tmp_path / "r"
    result = launch("--max-length", "8", "--run-dir", str(run_dir))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith(
        f"error: no sample of {demo_data_path()} fits --max-length 8: the shortest first prompt is "
    ), result.output
    assert (
        "raise --max-length (data.max_length) to at least" in lines[-1] and "Traceback" not in result.output
    )
    assert not (run_dir / "regenerated.jsonl").exists() and not (run_dir / "logs").exists()
    dataset = launch("--max-length", "8", "--responses", "dataset", "--run-dir", str(tmp_path / "d"))
    assert dataset.exit_code == 2, dataset.output
    assert "fits --max-length 8: the shortest sample is " in dataset.output


def test_min_workers_0_is_refused_and_more_than_this_launch_starts_is_planned(tmp_path: Path):
    """0 cannot be met by any group; more than this launch's own workers can (attached nodes bring the
    rest), so the plan says how they come."""
    refused = launch("--min-workers", "0", "--run-dir", str(tmp_path / "r"))
    assert refused.exit_code != 0 and "--min-workers) must be >= 1, got 0" in refused.output, refused.output
    assert "Traceback" not in refused.output and not (tmp_path / "r").exists()
    planned = launch("--workers", "2", "--min-workers", "4", "--run-dir", str(tmp_path / "r"), "--dry-run")
    assert planned.exit_code == 0, planned.output
    assert (
        "first step     once 4 drafters are in the group (--min-workers 4); this launch starts 2: the others"
        in (planned.output)
    )
