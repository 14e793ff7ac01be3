"""The launch loads the target while the data tokenizes; data errors surface, and nothing is left running."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dflash_pipe.data import DataConfig, DataError, demo_data_path
from dflash_pipe.data import loader as data_loader
from dflash_pipe.data.lines import LoadCancelled
from dflash_pipe.launcher import prepare
from dflash_pipe.producer import setup, target_threads
from dflash_pipe.producer.setup import OptionsError, prepare_run
from dflash_pipe.run.config import DrafterOptions, RunConfig
from dflash_pipe.run.layout import LayoutConfig


def config(run_dir: Path, data: Path | None = None, **drafter) -> RunConfig:
    return RunConfig(
        run_dir=run_dir,
        data=DataConfig(path=data or demo_data_path(), max_length=64),
        drafter=DrafterOptions(num_layers=1, **drafter),
        layout=LayoutConfig(device="cpu"),
    )


def tokenizing() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dflash-tokenize"]


def test_target_loads_while_the_data_tokenizes(tmp_path: Path, monkeypatch):
    """The tokenization cannot finish until the target load has started: prepare() only returns if the
    target is loaded concurrently (a serial order would fail here with the message below)."""
    target_started = threading.Event()
    seen = {}
    real = data_loader.tokenize_piece

    def tokenize_after_target_starts(*args, **kwargs):
        if not target_started.wait(timeout=30):
            raise AssertionError("the target load did not start while the data was tokenizing")
        return real(*args, **kwargs)

    def fake_load_replicas(pending):
        seen["data_done"] = pending.data.done()
        seen["layers"] = pending.drafter.target_layer_ids
        target_started.set()
        return ["replica"]

    monkeypatch.setattr(data_loader, "tokenize_piece", tokenize_after_target_starts)
    monkeypatch.setattr(target_threads, "load_replicas", fake_load_replicas)
    ctx, replicas = prepare(config(tmp_path / "r"), resume=False, live=False)
    assert replicas.result(timeout=30) == ["replica"]
    assert seen["data_done"] is False and seen["layers"] == ctx.drafter.target_layer_ids
    assert len(ctx.train_samples) > 100 and ctx.ledger.num_samples == len(ctx.train_samples)
    assert (tmp_path / "r" / "config.json").exists()
    assert tokenizing() == []


def test_a_data_error_surfaces_from_the_background(tmp_path: Path, monkeypatch):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}\n{not json\n')
    monkeypatch.setattr(target_threads, "load_replicas", lambda pending: [])
    with pytest.raises(DataError) as info:
        prepare(config(tmp_path / "r", data), resume=False, live=False)
    assert str(info.value).startswith(f"{data}:2: not JSON:")
    assert tokenizing() == []
    assert not (tmp_path / "r" / "config.json").exists()  # as before: a failed set-up saves no config


def test_a_setup_error_stops_the_tokenization(tmp_path: Path, monkeypatch):
    """A set-up error raised while the data tokenizes (the drafter shape, which needs the tokenizer's mask
    token) stops the tokenization (it would never end)."""
    running = threading.Event()

    def endless(*args, cancel, **kwargs):
        running.set()
        while not cancel.is_set():
            time.sleep(0.01)
        raise LoadCancelled("stopped")

    def from_target_while_tokenizing(*args, **kwargs):
        assert running.wait(timeout=30), (
            "the tokenization did not start before the drafter shape was resolved"
        )
        raise OptionsError("--mask-token-id: simulated")

    monkeypatch.setattr(data_loader, "tokenize_piece", endless)
    monkeypatch.setattr(setup.DrafterConfig, "from_target", from_target_while_tokenizing)
    with pytest.raises(OptionsError, match="simulated"):
        prepare_run(config(tmp_path / "r"), resume=False, progress=False)
    assert tokenizing() == []


def test_options_that_do_not_fit_the_target_stop_before_the_data_is_read(tmp_path: Path, monkeypatch):
    """Layer ids are checked against the target's config before the tokenizer loads or the data tokenizes."""
    started = []
    monkeypatch.setattr(data_loader, "tokenize_piece", lambda *a, **k: started.append(1))
    with pytest.raises(OptionsError, match="--target-layer-ids"):
        prepare_run(config(tmp_path / "r", target_layer_ids=(1, 99)), resume=False, progress=False)
    assert started == [] and tokenizing() == []
