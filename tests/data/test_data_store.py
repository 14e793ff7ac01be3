"""The on-disk sample store (``data/store.py``): exactly the in-memory samples for JSONL and parquet, reused
by the next load of the same data, rebuilt when the data, the settings or the tokenizer change, and when a
store is torn (a load killed mid-write, files cut short); errors are those of the in-memory path."""

from __future__ import annotations

import copy
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import conv

from dflash_pipe.data import (
    DataConfig,
    DataError,
    DataFuture,
    LoadedData,
    StoredSamples,
    load_samples,
    loader,
    sample_lengths,
)
from dflash_pipe.data.store import IDS, MASK, META

ROWS = [
    {"messages": conv((f"question {i} " * (1 + i % 4), f"answer {i} " * (1 + i % 7)))}
    if i % 3
    else {
        "input_ids": list(range(1, 6 + i)),
        "loss_mask": [i % 2] + [1] * (4 + i),
    }  # odd lengths: masks span bytes
    for i in range(40)
] + [
    {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1]},  # no anchor: dropped
    {"input_ids": list(range(1, 80)), "loss_mask": [0] * 10 + [1] * 69},  # cut at max_length
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(path, tok, store: Path | None = None, **kw) -> LoadedData:
    return load_samples(DataConfig(path=path, max_length=64, **kw), tok, store=store)


def same(a: LoadedData, b: LoadedData) -> None:
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples, strict=True):
        assert x.sample_id == y.sample_id
        assert x.input_ids.dtype == y.input_ids.dtype and x.input_ids.tolist() == y.input_ids.tolist()
        assert x.loss_mask.dtype == y.loss_mask.dtype and x.loss_mask.tolist() == y.loss_mask.tolist()
    assert (a.skipped_lines, a.truncated, a.dropped_short) == (b.skipped_lines, b.truncated, b.dropped_short)
    assert (a.skip_reasons, a.drop_reasons) == (b.skip_reasons, b.drop_reasons)
    assert a.lengths() == b.lengths() and a.num_tokens == b.num_tokens


@pytest.fixture
def small_pieces(monkeypatch):
    """In-process JSONL in pieces of ~300 bytes: samples reach the store over many pieces (mask bits carried
    across pieces)."""
    monkeypatch.setattr(loader, "MAX_PIECE_BYTES", 300)


@pytest.fixture
def tokenizations(monkeypatch) -> list[str]:
    """The labels of the loads that tokenized (a reused store tokenizes nothing)."""
    calls: list[str] = []
    real = loader._tokenize

    def counting(source, *args):
        calls.append(source.label)
        return real(source, *args)

    monkeypatch.setattr(loader, "_tokenize", counting)
    return calls


def test_store_gives_the_in_memory_samples_for_jsonl(tmp_path, tok, small_pieces):
    data = write_jsonl(tmp_path / "d.jsonl", [*ROWS, "not json", {"text": "no sample"}])
    want = load(data, tok, skip_bad_lines=True)
    got = load(data, tok, tmp_path / "samples", skip_bad_lines=True)
    assert isinstance(got.samples, StoredSamples) and isinstance(want.samples, list)
    assert want.truncated == 1 and want.dropped_short == 1 and want.skipped_lines == 2  # all counts checked
    same(want, got)
    same(want, load(data, tok, tmp_path / "samples", skip_bad_lines=True))  # reused: the same again


def test_store_gives_the_in_memory_samples_for_parquet(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    keys = ["messages", "input_ids", "loss_mask"]
    pq.write_table(
        pa.table({k: [r.get(k) for r in ROWS] for k in keys}), tmp_path / "d.parquet", row_group_size=7
    )
    want = load(tmp_path / "d.parquet", tok)
    same(want, load(tmp_path / "d.parquet", tok, tmp_path / "samples"))
    same(want, load(write_jsonl(tmp_path / "d.jsonl", ROWS), tok))  # and the JSONL of the same rows


def test_pretokenized_without_a_tokenizer_keeps_ids_past_uint32(tmp_path):
    rows = [{"input_ids": [1, 2**40, 7], "loss_mask": [1, 1, 1]}, {"input_ids": [5, 6], "loss_mask": [1, 1]}]
    data = write_jsonl(tmp_path / "big.jsonl", rows)
    got = load(data, None, tmp_path / "samples")
    assert got.samples[0].input_ids.tolist() == [1, 2**40, 7]
    same(load(data, None), got)


def test_a_second_load_reuses_the_store(tmp_path, tok, tokenizations):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    first = load(data, tok, tmp_path / "samples")
    meta = (tmp_path / "samples" / META).stat().st_mtime_ns
    second = load(data, tok, tmp_path / "samples")
    assert tokenizations == [str(data)]  # the second tokenized nothing
    assert (tmp_path / "samples" / META).stat().st_mtime_ns == meta
    same(first, second)
    with DataFuture(DataConfig(path=data, max_length=64), tok, store=tmp_path / "samples") as future:
        same(first, future.result())
    assert len(tokenizations) == 1


@pytest.mark.parametrize(
    "change",
    ["data", "max_length", "min_loss_tokens", "skip_bad_lines", "template arg", "tokenizer"],
)
def test_the_store_is_rebuilt_when_data_or_settings_change(tmp_path, tok, tokenizations, change):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    load(data, tok, tmp_path / "samples")
    kw: dict = {}
    tokenizer = tok
    if change == "data":
        write_jsonl(data, ROWS[:-3])
    elif change == "max_length":
        kw["max_length"] = 32
    elif change == "min_loss_tokens":
        kw["min_loss_tokens"] = 5
    elif change == "skip_bad_lines":
        kw["skip_bad_lines"] = True
    elif change == "template arg":
        kw["chat_template_kwargs"] = {"enable_thinking": False}
    else:
        tokenizer = copy.deepcopy(tok)
        tokenizer.add_tokens(["<zz_new_token>"])
    cfg = DataConfig(path=data, **{"max_length": 64, **kw})
    got = load_samples(cfg, tokenizer, store=tmp_path / "samples")
    assert len(tokenizations) == 2
    same(load_samples(cfg, tokenizer), got)


@pytest.mark.parametrize(
    "damage", ["ids cut short", "mask cut short", "no meta", "meta not JSON", "meta without its counts"]
)
def test_a_torn_store_is_rebuilt(tmp_path, tok, tokenizations, damage):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    want = load(data, tok)
    root = tmp_path / "samples"
    load(data, tok, root)
    if damage == "ids cut short":
        os.truncate(root / IDS, (root / IDS).stat().st_size - 4)
    elif damage == "mask cut short":
        os.truncate(root / MASK, 0)
    elif damage == "no meta":
        (root / META).unlink()
    elif damage == "meta not JSON":
        (root / META).write_text('{"key": ')
    else:  # the right key, a field missing
        meta = json.loads((root / META).read_text())
        del meta["left_out"]
        (root / META).write_text(json.dumps(meta))
    same(want, load(data, tok, root))
    assert len(tokenizations) == 3  # in memory, the store, the store again
    assert not (tmp_path / "samples.partial").exists()


KILLED_BUILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from data_helpers import SlowVocab
from dflash_pipe.data import DataConfig, load_samples, loader
loader.MAX_PIECE_BYTES = 200
load_samples(DataConfig(path=Path({data!r}), tokenize_workers=0), SlowVocab(0.05), store=Path({store!r}))
"""


def test_a_load_killed_mid_write_leaves_no_store_and_the_next_builds_one(tmp_path):
    from data_helpers import SlowVocab  # pre-tokenized rows; len() sleeps once per piece: a slow build

    rows = [{"input_ids": list(range(1, 4 + i % 9)), "loss_mask": [1] * (3 + i % 9)} for i in range(400)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    root = tmp_path / "samples"
    script = KILLED_BUILD.format(tests=str(Path(__file__).parent), data=str(data), store=str(root))
    child = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    partial_ids = tmp_path / "samples.partial" / IDS
    deadline = time.monotonic() + 60
    while not (partial_ids.exists() and partial_ids.stat().st_size > 0):
        assert child.poll() is None, "the build ended before it could be killed"
        assert time.monotonic() < deadline, "the build wrote nothing in 60 s"
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert not root.exists()  # only the partial folder: nothing that a load would take as a store
    vocab = SlowVocab(0, size=10_000)
    same(load(data, vocab), load(data, vocab, root))
    assert not (tmp_path / "samples.partial").exists()


def test_errors_are_unchanged_and_leave_no_store(tmp_path, tok, small_pieces):
    data = write_jsonl(tmp_path / "d.jsonl", [*ROWS[:20], {"text": "no sample"}, *ROWS[20:]])
    with pytest.raises(DataError) as in_memory:
        load(data, tok)
    with pytest.raises(DataError) as stored:
        load(data, tok, tmp_path / "samples")
    assert str(stored.value) == str(in_memory.value)
    assert str(stored.value).startswith(f"{data}:21: wrong schema")
    assert not (tmp_path / "samples").exists() and not (tmp_path / "samples.partial").exists()


def test_an_unwritable_store_names_the_folder(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "file").write_text("")  # the store's parent is a file: its folder cannot be made
    with pytest.raises(
        DataError, match=r"file/samples.partial: cannot write the tokenized samples of .*d.jsonl"
    ):
        load(data, tok, tmp_path / "file" / "samples")


def test_views_keep_ids_and_pickle_without_the_data(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    want = load(data, tok).samples
    stored = load(data, tok, tmp_path / "samples").samples
    tail = stored[30:]  # the held-out tail: ids count in the whole set, as for the list
    assert [s.sample_id for s in tail] == [s.sample_id for s in want[30:]]
    assert tail[-1].input_ids.tolist() == want[-1].input_ids.tolist()
    assert [s.sample_id for s in stored[::7]] == [s.sample_id for s in want[::7]]
    assert sample_lengths(tail).tolist() == sample_lengths(want[30:]).tolist()
    with pytest.raises(IndexError):
        tail[len(tail)]
    blob = pickle.dumps(tail)
    assert len(blob) < 500  # the folder and the range, never the tokens
    back = pickle.loads(blob)
    assert [s.loss_mask.tolist() for s in back] == [s.loss_mask.tolist() for s in want[30:]]
    assert isinstance(sample_lengths(stored), np.ndarray)
