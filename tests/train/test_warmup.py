"""The compile warm-up: once (one worker compiles under the cache's lock) or each (no lock, no waiting)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from dflash_pipe.bench.compile import together_summary
from dflash_pipe.compute.compile import backward_with_settings
from dflash_pipe.compute.precision import autocast
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.drafter import DFlashDrafter
from dflash_pipe.drafter.masks import sample_anchors, training_eligible
from dflash_pipe.run.dir import RunDir
from dflash_pipe.train.build import apply_compile
from dflash_pipe.train.warmup import fewer_anchors, synthetic_batch, warm_up, warmup_batches, warmup_lengths
from tests.drafter.conftest import tiny_config, tiny_drafter


def _warm(cache: Path, *, once: bool) -> dict[str, float]:
    cfg = dataclasses.replace(tiny_config(), attention_backend="sdpa")
    return warm_up(
        tiny_drafter(cfg),
        drafter_config=cfg.to_dict(),
        cache_dir=cache,
        device=torch.device("cpu"),
        seq_len=16,
        once=once,
    )


def test_once_compiles_first_then_starts_warm(tmp_path: Path):
    first, second = _warm(tmp_path, once=True), _warm(tmp_path, once=True)
    assert first["warmup_cold"] == 1.0 and second["warmup_cold"] == 0.0
    assert second["warmup_waited_s"] == 0.0  # the marker exists: no lock needed


def test_each_never_waits_for_the_lock(tmp_path: Path):
    """With the lock held by another worker (here: this test), "each" warms up anyway and marks the cache;
    "once" would block on it until the holder is done."""
    with FileLock(str(tmp_path / "warmup.lock")):
        got = _warm(tmp_path, once=False)
    assert got["warmup_cold"] == 1.0 and got["warmup_waited_s"] == 0.0
    assert _warm(tmp_path, once=True)["warmup_cold"] == 0.0  # the marker it left


def test_once_waits_for_the_worker_that_holds_the_lock(tmp_path: Path):
    """Another worker (a thread here) holds the lock for a while: "once" waits for it, then, finding no
    marker (the holder left none), compiles itself."""
    held = threading.Event()

    def hold() -> None:
        with FileLock(str(tmp_path / "warmup.lock")):
            held.set()
            time.sleep(0.5)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(timeout=10)
    try:
        got = _warm(tmp_path, once=True)
    finally:
        holder.join()
    assert got["warmup_waited_s"] >= 0.3 and got["warmup_cold"] == 1.0


def test_compile_warmup_setting_is_validated():
    assert TrainConfig().compile_warmup == "each"  # measured: 1.04x cold for 2 together, once 1.26x
    with pytest.raises(ValueError, match="compile_warmup must be once or each"):
        TrainConfig(compile_warmup="twice")  # type: ignore[arg-type]


def test_bench_compile_reports_each_mode_against_cold():
    s = together_summary({"once": 51.0, "each": 44.0}, cold_s=40.0)
    assert s == {
        "together_slowest_s": 51.0,
        "together_vs_cold": 1.275,
        "together_each_slowest_s": 44.0,
        "together_each_vs_cold": 1.1,
    }


def test_compile_warmup_flag_and_bench_modes(tmp_path: Path):
    from dflash_pipe.bench.compile import run_compile_bench
    from dflash_pipe.commands.launch_config import build_run_config

    cfg, _ = build_run_config({"run_dir": tmp_path / "run", "device": "cpu", "compile_warmup": "each"})
    assert cfg.train.compile_warmup == "each"
    RunDir(tmp_path / "run").save_config(cfg)
    resumed, _ = build_run_config({"resume_dir": tmp_path / "run", "compile_warmup": "once"})
    assert resumed.train.compile_warmup == "once"  # a start-up choice: it may change on --resume
    with pytest.raises(ValueError, match="once and/or each"):
        run_compile_bench(target_model=None, device="cpu", warmups=("twice",), work_dir=tmp_path)
    with pytest.raises(ValueError, match="sizes >= 1"):
        run_compile_bench(target_model=None, device="cpu", warmup_batch_sizes=(2, 0), work_dir=tmp_path)


@pytest.mark.parametrize("max_anchors", [512, 32])
def test_warm_up_meets_two_anchor_counts_per_batch_size(max_anchors: int):
    """Per batch size, the warm-up's batches give the drafter two anchor counts (the cap, and 5/8 of it),
    so a graph whose first compile tied the anchor count to an equal-sized dimension compiles its general
    variant here, not at the first real batch with fewer anchors."""
    cfg = dataclasses.replace(tiny_config(), max_anchors=max_anchors).to_dict()
    seq_len = 4 * max_anchors
    batches = warmup_batches(cfg, torch.device("cpu"), seq_len, (2, 1))
    seen: dict[int, set[tuple[int, int]]] = {}
    for ids, feats, mask in batches:
        assert ids.shape == feats.shape[:2] == mask.shape
        anchors, _ = sample_anchors(training_eligible(mask), max_anchors)
        seen.setdefault(ids.shape[0], set()).add((ids.shape[1], anchors.shape[1]))
    short = warmup_lengths(seq_len)[-1]
    for b in (2, 1):
        assert {n for _, n in seen[b]} == {max_anchors, fewer_anchors(max_anchors)}, seen
        assert (short, fewer_anchors(max_anchors)) in seen[b]


@pytest.mark.slow
def test_a_batch_with_fewer_anchors_compiles_nothing_after_the_warm_up(tmp_path: Path):
    """Whole layers compiled (CPU, SDPA). At the anchor cap the block tokens (16 anchors x 4) number 64, the
    hidden size: the first compile made them one size (duck sizing) and specialised both to the weights'
    64, so with a warm-up at the cap only, the first real batch with fewer anchors compiled again. About a
    minute in a full suite, most of it the real cold compile: recompiles are only counted on a real one."""
    cfg = dataclasses.replace(
        tiny_config(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        layer_types=("full_attention",),
        head_dim=16,
        block_size=4,
        max_anchors=16,
        attention_backend="sdpa",
    )
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(cfg.vocab_size, 64), torch.nn.Linear(64, cfg.vocab_size, bias=False)
    model = DFlashDrafter(cfg, embed, head)
    apply_compile(model, attention=False, layers=True)
    cpu = torch.device("cpu")
    warm_up(model, drafter_config=cfg.to_dict(), cache_dir=tmp_path, device=cpu, seq_len=64, batch_sizes=(2,))
    ids, feats, mask = synthetic_batch(cfg.to_dict(), cpu, 2, 32)  # the warm-up's shorter length
    mask[:, :20] = False  # 11 anchors
    with torch.compiler.set_stance("fail_on_recompile"), autocast(cpu):
        out = model(ids, feats, mask, generator=torch.Generator().manual_seed(0))
        backward_with_settings(out.loss_sum)
    assert all(p.grad is not None for p in model.trainable_parameters())
