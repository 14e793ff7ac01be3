"""The warm-up's check of the compiled step against the eager SDPA one, and the fallback to attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.drafter.model import run_layer
from dflash_pipe.train import build
from dflash_pipe.train.compile_check import check_compiled, warm_up_checked
from dflash_pipe.train.warmup import warm_up
from tests.drafter.conftest import tiny_config, tiny_drafter

CPU = torch.device("cpu")


def _full_drafter():
    """A tiny drafter compiled as train.compile=full compiles it (the layers whole; on CPU: around SDPA)."""
    model = tiny_drafter(tiny_config())
    build.apply_compile_plan(model, "full", CPU)
    return model


def _warm(model, tmp_path: Path) -> dict[str, float]:
    cfg = model.cfg.to_dict()
    return warm_up_checked(model, full=True, drafter_config=cfg, cache_dir=tmp_path, device=CPU, seq_len=16)


def _wrong_kernel():
    """Stands in for a miscompiled layer: the right values, one position off (a wrong index)."""

    def compiled():
        def run(layer, x, ctx, rope_q, rope_k, attend):
            return run_layer(layer, x, ctx, rope_q, rope_k, attend).roll(1, dims=1)

        return run

    return compiled


@pytest.mark.slow
def test_a_correct_compile_passes_and_stays_full(tmp_path: Path) -> None:
    """About 50 s in a full suite, most of it torch.compile of the tiny drafter's whole layers on CPU (Dynamo,
    AOT autograd, Inductor's lowering, then g++), for the warm-up alone and again for a second model's
    warm-up, check and verdict. A check of eager against eager would pass without proving anything."""
    from torch._dynamo.utils import counters

    model = _full_drafter()
    cfg = model.cfg.to_dict()
    warm_up(model, drafter_config=cfg, cache_dir=tmp_path, device=CPU, seq_len=16)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # compiled for real
    check = check_compiled(model, cfg, CPU, 8)  # the warm-up's shorter length (16 // 2)
    assert check.ok and check.error is None
    assert check.loss_rel < 1e-4 and check.grad_rel < 1e-3  # fp32: the same math by another route
    assert counters["stats"]["unique_graphs"] == graphs  # the check's batch is a shape the warm-up compiled
    metrics = _warm(_full_drafter(), tmp_path)  # warm-up, check and verdict together
    assert metrics["compile_fallback"] == 0.0 and metrics["compile_check_grad_rel"] < 1e-3


def test_a_wrong_kernel_falls_back_to_attention(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(build, "_compiled_layer", _wrong_kernel())
    model = _full_drafter()
    check = check_compiled(model, model.cfg.to_dict(), CPU, 16)
    assert not check.ok and check.grad_rel > 5e-2, check
    assert "disagrees with the eager one" in check.describe()
    with pytest.warns(RuntimeWarning, match="trains on with train.compile=attention"):
        metrics = _warm(model, tmp_path)
    assert metrics["compile_fallback"] == 1.0 and metrics["compile_check_grad_rel"] > 5e-2
    assert model.kernels.layer is run_layer and model.kernels.fused_ce is False  # re-applied with less
    assert model.kernels.compile_attention is True  # the fallback keeps the attention compiled
    assert model.kernels.tuned_flex_tiles is False  # ... with Inductor's own tiles
    assert check_compiled(model, model.cfg.to_dict(), CPU, 16).ok  # the wrong kernel is out of the step


def test_a_kernel_failing_at_run_time_falls_back(tmp_path: Path, monkeypatch) -> None:
    def failing():
        def run(*_args):
            raise RuntimeError("shape '[1280, 128]' is invalid for input of size 256")

        return run

    monkeypatch.setattr(build, "_compiled_layer", failing)
    model = _full_drafter()
    with pytest.warns(RuntimeWarning, match=r"failed at run time \(RuntimeError: shape"):
        metrics = _warm(model, tmp_path)
    assert metrics["compile_fallback"] == 1.0 and "compile_check_loss_rel" not in metrics
    assert model.kernels.layer is run_layer


def test_running_out_of_memory_is_not_a_fallback(tmp_path: Path, monkeypatch) -> None:
    """Out of memory says nothing about the kernels: it reaches the worker (and the user) as it is."""

    def oom():
        def run(*_args):
            raise torch.OutOfMemoryError("CUDA out of memory")

        return run

    monkeypatch.setattr(build, "_compiled_layer", oom)
    with pytest.raises(torch.OutOfMemoryError):
        _warm(_full_drafter(), tmp_path)


def test_compile_plan_resolves_auto_and_the_old_name() -> None:
    assert TrainConfig().compile == "auto"
    assert TrainConfig().compile_plan("cuda") == "full"
    assert TrainConfig().compile_plan("cpu") == "off"
    assert TrainConfig(compile="on").compile_plan("cuda") == "attention"
    assert TrainConfig(compile="attention").compile_plan("cpu") == "attention"
    assert TrainConfig(compile="off").compile_plan("cuda") == "off"
    with pytest.raises(ValueError, match="train.compile must be"):
        TrainConfig(compile="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: flex attention and the fused CE terms")
def test_the_default_full_compile_passes_its_check_on_cuda(tmp_path: Path) -> None:
    """What a CUDA worker runs by default: build_drafter with train.compile=auto (= full), warm-up, check."""
    from torch import nn

    cuda = torch.device("cuda")
    cfg = tiny_config(hidden_size=128, intermediate_size=256, head_dim=32, num_attention_heads=4)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=cuda, dtype=torch.bfloat16)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=cuda, dtype=torch.bfloat16)
    model, compiled = build.build_drafter(cfg, TrainConfig(), embed, head, cuda)
    assert compiled and isinstance(model.kernels.layer, build.CompiledLayers) and model.kernels.fused_ce
    metrics = warm_up_checked(
        model, full=True, drafter_config=cfg.to_dict(), cache_dir=tmp_path, device=cuda, seq_len=128
    )
    assert metrics["compile_fallback"] == 0.0, metrics
    assert metrics["compile_check_grad_rel"] < 5e-2 and isinstance(model.kernels.layer, build.CompiledLayers)
