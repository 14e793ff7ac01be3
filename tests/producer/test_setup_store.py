"""A run keeps its tokenized samples in ``RUN_DIR/samples`` (memory-mapped): the train/eval split, sample
ids and tokens are those of the in-memory load, and a second set-up on the same run dir (a resume) reuses
the store instead of tokenizing again."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_pipe.data import DataConfig, StoredSamples, demo_data_path, load_samples, loader
from dflash_pipe.producer.setup import held_out_count, prepare_run
from dflash_pipe.run.config import DrafterOptions, RunConfig
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.layout import LayoutConfig


def config(run_dir: Path) -> RunConfig:
    return RunConfig(
        run_dir=run_dir,
        data=DataConfig(path=demo_data_path(), max_length=64),
        drafter=DrafterOptions(num_layers=1),
        layout=LayoutConfig(device="cpu"),
    )


@pytest.mark.slow  # tokenizes the whole demo set and writes its store: ~15 s on 2 shared cores
def test_a_run_trains_from_its_store_and_reuses_it(tmp_path: Path, monkeypatch):
    cfg = config(tmp_path / "r")
    ctx = prepare_run(cfg, resume=False, progress=False)
    assert (
        isinstance(ctx.train_samples, StoredSamples) and (RunDir(cfg.run_dir).samples / "meta.json").exists()
    )
    want = load_samples(cfg.data, ctx.tokenizer).samples  # in memory
    n_eval = held_out_count(cfg.eval_samples, len(want))
    assert len(ctx.train_samples) == len(want) - n_eval and len(ctx.eval_samples) == n_eval > 0
    for got, ref in ((ctx.train_samples, want[: len(want) - n_eval]), (ctx.eval_samples, want[-n_eval:])):
        picks = [0, len(ref) // 2, len(ref) - 1]
        assert [got[i].sample_id for i in picks] == [ref[i].sample_id for i in picks]
        assert [got[i].input_ids.tolist() for i in picks] == [ref[i].input_ids.tolist() for i in picks]
        assert [got[i].loss_mask.tolist() for i in picks] == [ref[i].loss_mask.tolist() for i in picks]
    assert ctx.ledger.num_samples == len(ctx.train_samples)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the store should have been reused")

    monkeypatch.setattr(loader, "_tokenize", no_tokenizing)
    again = prepare_run(cfg, resume=True, progress=False)  # config.json is there: a resume of nothing yet
    assert isinstance(again.train_samples, StoredSamples) and len(again.train_samples) == len(
        ctx.train_samples
    )
