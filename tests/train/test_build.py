"""``train.build``: the drafter built eager, then checkpointed and compiled; what was applied shows on the
model, changes no numbers, and the compile check's fallback re-applies with less."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.drafter import CheckpointPolicy, DFlashDrafter
from dflash_pipe.drafter.model import DFlashLayer, Kernels, run_layer
from dflash_pipe.train import build
from dflash_pipe.train.compile_check import warm_up_checked
from tests.drafter.conftest import loss_and_grads, tiny_config

CPU = torch.device("cpu")


def _built(train: TrainConfig, **kwargs) -> DFlashDrafter:
    """A tiny drafter through ``build_drafter``, its weights fixed by the seed (the same for every call)."""
    cfg = tiny_config()
    torch.manual_seed(0)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    model, _ = build.build_drafter(cfg, train, embed, head, CPU, **kwargs)
    return model


def test_a_built_drafter_with_checkpointing_trains_as_the_eager_one(monkeypatch) -> None:
    """Real backward, fp32 on CPU: the same loss and every gradient, while the layers really recompute."""
    eager = _built(TrainConfig(activation_checkpointing="none"))
    checkpointed = _built(TrainConfig(activation_checkpointing="all"))
    assert eager.checkpointing == CheckpointPolicy("none")
    assert checkpointed.checkpointing == CheckpointPolicy("all")  # the applied policy, on the model
    assert eager.kernels == checkpointed.kernels == Kernels(compile_attention=False)  # compile off on CPU
    want_loss, want = loss_and_grads(eager)
    runs = []
    layer_forward = DFlashLayer.forward
    monkeypatch.setattr(DFlashLayer, "forward", lambda self, *a: runs.append(1) or layer_forward(self, *a))
    loss, got = loss_and_grads(checkpointed)
    assert len(runs) == 2 * checkpointed.cfg.num_hidden_layers  # forward, then again in backward
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        assert want[name].abs().sum() > 0, name  # every parameter really gets a gradient
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_an_explicit_policy_wins_over_the_config() -> None:
    """The worker passes its own policy (threaded mode allows non-reentrant checkpoints only)."""
    policy = CheckpointPolicy("layers", mode="threaded")
    model = _built(TrainConfig(activation_checkpointing="all"), checkpointing=policy)
    assert model.checkpointing is policy and model.training


@pytest.mark.parametrize(
    ("compile", "override", "layers", "attention", "fused_ce"),
    [
        ("off", None, False, False, False),
        ("off", True, True, False, False),  # the compile bench on CPU
        ("attention", None, True, True, False),  # the SDPA path compiles its layers
        ("full", None, True, True, True),
    ],
)
def test_the_compile_plan_shows_on_the_model(
    compile: str, override: bool | None, layers: bool, attention: bool, fused_ce: bool
) -> None:
    """What ``train.compile`` (and the bench's layer override) applied, read back from ``model.kernels``;
    nothing is compiled yet (that happens on the first step)."""
    model = _built(TrainConfig(compile=compile), compile_layers=override)  # type: ignore[arg-type]
    k = model.kernels
    assert isinstance(k.layer, build.CompiledLayers) is layers and (k.layer is run_layer) is not layers
    assert (k.compile_attention, k.fused_ce, k.tuned_flex_tiles) == (attention, fused_ce, True)


def test_apply_compile_replaces_what_was_applied() -> None:
    """Re-applying sets a new value: the one applied before is left as it was (no flag flipped on it)."""
    model = _built(TrainConfig(compile="full"))
    before = model.kernels
    build.apply_attention_only(model)
    assert isinstance(before.layer, build.CompiledLayers) and before.fused_ce and before.tuned_flex_tiles
    assert model.kernels == Kernels(layer=run_layer, compile_attention=True, tuned_flex_tiles=False)


def test_the_fallback_trains_with_the_lesser_setting(tmp_path: Path, monkeypatch) -> None:
    """train.compile=full whose compiled layers compute wrong numbers (one position off, as a miscompiled
    index would): the warm-up's check sees it for real, re-applies attention only, and the model then
    trains with eager layers to the eager drafter's loss and gradients."""

    def wrong_kernel():
        return lambda layer, x, *rest: run_layer(layer, x, *rest).roll(1, dims=1)

    monkeypatch.setattr(build, "_compiled_layer", wrong_kernel)
    model = _built(TrainConfig(compile="full"))
    with pytest.warns(RuntimeWarning, match="trains on with train.compile=attention"):
        metrics = warm_up_checked(
            model, full=True, drafter_config=model.cfg.to_dict(), cache_dir=tmp_path, device=CPU, seq_len=16
        )
    assert metrics["compile_fallback"] == 1.0
    assert model.kernels == Kernels(layer=run_layer, compile_attention=True, tuned_flex_tiles=False)
    want_loss, want = loss_and_grads(_built(TrainConfig(compile="off")))
    loss, got = loss_and_grads(model)
    torch.testing.assert_close(loss, want_loss)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], msg=name)
