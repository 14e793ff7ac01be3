"""Every recipe in launch/ parses and validates: its config through `launch --dry-run`, its script as written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_pipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
RUN_CONFIGS = sorted(
    p for p in LAUNCH.rglob("*") if p.suffix in (".yaml", ".toml") and p.name != "worker.yaml"
)
SCRIPTS = sorted([*LAUNCH.rglob("*.sh"), *LAUNCH.rglob("*.sbatch")])
LAUNCH_SCRIPTS = [p for p in SCRIPTS if p.name != "worker.sh"]


def test_the_recipes_are_there():
    names = {str(p.relative_to(LAUNCH)) for p in [*RUN_CONFIGS, *SCRIPTS]}
    for name in (
        "node-8gpu.yaml",
        "qwen3.6-27b.yaml",
        "one-gpu.yaml",
        "cpu-demo.yaml",
        "two-nodes/producer.yaml",
        "slurm.sbatch",
        "slurm-multinode.sbatch",
        "multinode.sh",
    ):
        assert name in names, name
    for script in SCRIPTS:  # each says when to use it
        head = script.read_text().splitlines()[:6]
        assert any(line.startswith("#") and "Use" in line for line in head), script


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=lambda p: str(p.relative_to(LAUNCH)))
def test_config_validates_with_dry_run(config: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        main,
        ["launch", "--config", str(config), "--run-dir", str(run_dir), "--dry-run"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "nothing was started" in out and f"run dir        {run_dir} (new)" in out
    assert "resolved config" in out and "workers" in out
    if "device: cuda" in config.read_text():
        assert "GPU ids were not checked against this machine (dry run)" in out
    assert not run_dir.exists()  # a dry run creates nothing


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # the venv's dflash-pipe
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "TARGET_MODEL", "DATA", "RECIPE")}
    return {**env, "PATH": bin_dir + os.pathsep + env.get("PATH", "")}


def _multinode_dry_run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH / "multinode.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", LAUNCH_SCRIPTS, ids=lambda p: str(p.relative_to(LAUNCH)))
def test_script_runs_as_written_with_dry_run(script: Path, tmp_path: Path):
    env = {**_env(), "RUN_DIR": str(tmp_path / "run"), "SLURM_SUBMIT_DIR": str(ROOT)}
    out = subprocess.run(
        ["bash", str(script), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nothing was started" in out.stdout
    assert str(tmp_path / "run") in out.stdout and not (tmp_path / "run").exists()


def test_two_node_worker_recipe_parses(tmp_path: Path):
    worker = main.commands["worker"]
    ctx = worker.make_context(
        "worker", ["--config", str(LAUNCH / "two-nodes" / "worker.yaml"), "--connect", "tcp://node-a:5555"]
    )
    assert ctx.params["gpus"] == "0-7" and ctx.params["connect"] == "tcp://node-a:5555"
    out = subprocess.run(
        ["bash", str(LAUNCH / "two-nodes" / "worker.sh")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "set PRODUCER_HOST" in out.stderr


def test_the_qwen36_recipe_plans_the_original_topology_on_a_hybrid_target(tmp_path: Path):
    """launch/qwen3.6-27b.yaml with its target path pointed at a tiny local Qwen3.5-architecture hybrid (8
    layers: 5 feature layers need at least 8): the dry run reads that target's config, accepts it with the
    recipe's drafter, and plans 5 target replicas on GPUs 0-4 and 3 drafter workers on GPUs 5-7."""
    import transformers
    import yaml

    from tests.target.families import FAMILIES, qwen3_5_text

    assert "qwen3_5-text" in FAMILIES  # the installed transformers has Qwen3.5
    target = tmp_path / "qwen3_5"
    config = qwen3_5_text(128, layers=8)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(target)
    recipe = ["launch", "--config", str(LAUNCH / "qwen3.6-27b.yaml"), "--target-model", str(target)]
    run_dir = ["--run-dir", str(tmp_path / "run")]
    result = CliRunner().invoke(main, [*recipe, *run_dir, "--dry-run"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"target         {target}\n" in out
    assert "qwen3_5_text; 8 layers, hidden 32; 6 linear_attention + 2 full_attention; runs packed rows" in out
    assert "target GPUs    cuda:0, cuda:1, cuda:2, cuda:3, cuda:4 (5 replica thread(s)" in out
    assert "drafter GPUs   cuda:5, cuda:6, cuda:7 (one worker process each, NCCL)" in out
    printed = CliRunner().invoke(main, [*recipe, *run_dir, "--print-config"], catch_exceptions=False)
    drafter = yaml.safe_load(printed.output)["drafter"]
    assert drafter["num_layers"] == 5 and drafter["block_size"] == 16
    assert drafter["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert drafter["sliding_window"] == 2048


@pytest.mark.parametrize("rank", ["1", "7"])
def test_multinode_recipe_attaches_every_other_node_as_a_producer(rank: str, tmp_path: Path):
    """launch/multinode.sh on a node other than 0 (torchrun-style MASTER_ADDR / NODE_RANK): a producer that
    joins node 0's coordinator with that node's own split of GPUs and the run's keys."""
    env = {**_env(), "RUN_DIR": str(tmp_path / "run"), "MASTER_ADDR": "node-a", "NODE_RANK": rank}
    env.update({"MASTER_PORT": "6000", "TARGET_GPUS": "0-5", "DRAFTER_GPUS": "6,7"})
    out = _multinode_dry_run(env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout
    assert f"producer node{rank} (dry run): would join the run at tcp://node-a:6000" in lines
    assert "cuda:0, cuda:1, cuda:2, cuda:3, cuda:4, cuda:5" in lines and "2 on cuda:6, cuda:7" in lines
    assert f"keys           {tmp_path / 'run'}.keys" in lines and "nothing was started" in lines
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.keys").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "needed"),
    [({"NNODES": "3"}, "12"), ({"NNODES": "2", "DRAFTER_GPUS": "0,2,5-6"}, "8"), ({}, None)],
)
def test_multinode_recipe_waits_for_the_whole_cluster(
    extra: dict[str, str], needed: str | None, tmp_path: Path
):
    """Node 0 of launch/multinode.sh with NNODES: no step before every node's drafters are in (--min-workers
    = nodes x drafter GPUs per node); without it, today's start with whoever is in."""
    env = {**_env(), "RUN_DIR": str(tmp_path / "run"), "NODE_RANK": "0", **extra}
    out = _multinode_dry_run(env)
    assert out.returncode == 0, out.stdout + out.stderr
    if needed is None:
        assert "  min_workers: 1\n" in out.stdout and "first step" not in out.stdout
    else:
        assert f"  min_workers: {needed}\n" in out.stdout, out.stdout
        assert (
            f"first step     once {needed} drafters are in the group (--min-workers {needed})" in out.stdout
        )
