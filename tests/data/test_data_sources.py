"""--data beyond JSONL: parquet, arrow shards, save_to_disk folders and cached Hub ids give the JSONL
path's samples, errors and counts for the same rows; missing extra, uncached ids, streaming, regeneration."""

from __future__ import annotations

import glob
import json
import shutil
import socket
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
from data_helpers import conv

pytest.importorskip(
    "datasets"
)  # the test extra installs it; without it only the missing-extra test means much

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from dflash_pipe.data import DataConfig, DataError, DataFuture, LoadedData, load_samples, loader, pool  # noqa: E402
from dflash_pipe.data.conversations import load_conversations  # noqa: E402
from dflash_pipe.data.lines import Tokenized  # noqa: E402
from dflash_pipe.data.regenerated import source_digest  # noqa: E402
from dflash_pipe.data.resolved import TableSource  # noqa: E402
from dflash_pipe.data.sources import resolve_source  # noqa: E402
from dflash_pipe.data.tables import record_batches  # noqa: E402


def mixed_rows(n: int = 24) -> list[dict]:
    """Messages, ShareGPT and pre-tokenized rows, a dropped and a cut one (a column has one type: the masks
    are ints here, bools in ``test_a_bool_loss_mask_column``)."""
    out: list[dict] = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append({"messages": conv((f"question {i} " * (1 + i % 4), f"answer {i} " * (1 + i % 6)))})
        elif kind == 1:
            out.append(
                {"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": "yo"}]}
            )
        elif kind == 2:
            out.append({"input_ids": list(range(1, 5 + i)), "loss_mask": [1] * (4 + i)})
        elif kind == 3:
            out.append({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1]})  # no anchor: dropped
        else:
            out.append({"input_ids": list(range(1, 80)), "loss_mask": [0] * 10 + [1] * 69})  # cut at 64
    return out


BAD_ROWS = [  # (row, reason): each fits the table schema of mixed_rows
    (
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]},
        "wrong schema",
    ),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "length mismatch"),
    ({"input_ids": [1, 99999, 3], "loss_mask": [0, 1, 1]}, "ids >= vocab size"),
    ({"input_ids": [1, -1, 3], "loss_mask": [0, 1, 1]}, "negative ids"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}, "bad loss_mask"),
    ({"input_ids": [1, 2, 3]}, "wrong schema"),
    ({}, "wrong schema"),  # every column null
]


def table(rows: list[dict]) -> pa.Table:
    """Rows as a table of every key any row has (null where a row has none), as a mixed dataset is stored."""
    keys = list(dict.fromkeys(k for r in rows for k in r)) or ["messages"]
    return pa.table({k: [r.get(k) for r in rows] for k in keys})


def dataset(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset(table(rows))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_arrow_file(path: Path, rows: list[dict]) -> Path:
    """An arrow IPC *file* (not the stream format datasets writes), in batches of 5 rows."""
    t = table(rows)
    with pa.ipc.new_file(str(path), t.schema) as w:
        for b in t.to_batches(max_chunksize=5):
            w.write_batch(b)
    return path


def load(path, tok, **kw) -> LoadedData:
    return load_samples(DataConfig(path=path, max_length=64, **kw), tok)


def same(a: LoadedData, b: LoadedData) -> None:
    assert [s.sample_id for s in a.samples] == [s.sample_id for s in b.samples]
    assert [s.input_ids.tolist() for s in a.samples] == [s.input_ids.tolist() for s in b.samples]
    assert [s.loss_mask.tolist() for s in a.samples] == [s.loss_mask.tolist() for s in b.samples]
    assert (a.skip_reasons, a.drop_reasons, a.truncated) == (b.skip_reasons, b.drop_reasons, b.truncated)


@pytest.fixture
def tables(tmp_path) -> dict[str, Path | str]:
    """The same rows as JSONL and as every table source."""
    rows = mixed_rows()
    ds = dataset(rows)
    ds.save_to_disk(str(tmp_path / "disk"), num_shards=3)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "shards").mkdir()
    for i, start in enumerate(range(0, len(rows), 10)):  # 3 parquet shards: 10, 10, 4 rows
        pq.write_table(table(rows[start : start + 10]), tmp_path / "shards" / f"part-{i:05d}.parquet")
    pq.write_table(table(rows), tmp_path / "all.parquet", row_group_size=7)
    return {
        "jsonl": write_jsonl(tmp_path / "all.jsonl", rows),
        "parquet": tmp_path / "all.parquet",
        "parquet folder": tmp_path / "shards",
        "parquet glob": str(tmp_path / "shards" / "part-*.parquet"),
        "arrow file": write_arrow_file(tmp_path / "all.arrow", rows),
        "save_to_disk": tmp_path / "disk",
        "save_to_disk shard glob": str(tmp_path / "disk" / "*.arrow"),
        "DatasetDict (its train split)": tmp_path / "dict",
    }


def test_every_table_source_gives_the_jsonl_samples(tables, tok):
    want = load(tables["jsonl"], tok)
    assert want.drop_reasons and want.truncated  # the rows exercise drops and cuts
    for name, path in tables.items():
        got = load(path, tok)
        assert len(got.samples) == len(want.samples), name
        same(got, want)


def test_a_bool_loss_mask_column(tmp_path, tok):
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [False, True, True, True]}]
    pq.write_table(table(rows), tmp_path / "b.parquet")
    same(load(tmp_path / "b.parquet", tok), load(write_jsonl(tmp_path / "b.jsonl", rows), tok))
    assert load(tmp_path / "b.parquet", tok).samples[0].loss_mask.tolist() == [False, True, True, True]


def test_bad_rows_name_the_data_the_row_and_the_reason(tmp_path, tok):
    rows = mixed_rows(6)
    data = tmp_path / "bad.parquet"
    for bad, reason in BAD_ROWS:
        pq.write_table(table([*rows, bad]), data)
        with pytest.raises(DataError, match=f"^{data}:6: {reason}: ") as info:
            load(data, tok)
        assert "\n" not in str(info.value)


def test_skip_bad_lines_counts_rows_as_jsonl_counts_lines(tmp_path, tok):
    rows = mixed_rows(10)
    mixed = [rows[0], *(bad for bad, _ in BAD_ROWS), *rows[1:]]
    jsonl = write_jsonl(tmp_path / "m.jsonl", mixed)
    pq.write_table(table(mixed), tmp_path / "m.parquet")
    want, got = load(jsonl, tok, skip_bad_lines=True), load(tmp_path / "m.parquet", tok, skip_bad_lines=True)
    assert got.skipped_lines == want.skipped_lines == len(BAD_ROWS)
    same(got, want)


def test_row_numbers_count_across_shards_from_zero(tmp_path, tok):
    rows = mixed_rows(10)
    rows[7] = {"input_ids": [1, 2, 3], "loss_mask": [0, 1]}
    dataset(rows).save_to_disk(str(tmp_path / "d"), num_shards=3)  # row 7: third shard
    with pytest.raises(DataError, match=f"^{tmp_path / 'd'}:7: length mismatch"):
        load(tmp_path / "d", tok)


def test_a_table_without_a_sample_column_is_one_clear_error(tmp_path, tok):
    pq.write_table(table([{"text": "hello", "id": 1}]), tmp_path / "t.parquet")
    with pytest.raises(
        DataError, match=r"t.parquet has no 'messages', 'conversations' or 'input_ids' column"
    ):
        load(tmp_path / "t.parquet", tok, skip_bad_lines=True)


def test_without_datasets_a_table_says_how_to_install_it(tables, tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now fails
    for name in ("parquet", "save_to_disk", "arrow file"):
        with pytest.raises(DataError, match=r"pip install 'dflash-pipe\[data\]'") as info:
            load(tables[name], tok)
        assert "\n" not in str(info.value)
    assert load(tables["jsonl"], tok).samples  # JSONL needs no datasets


def test_tables_are_read_in_bounded_batches_and_lazily(tables):
    source = resolve_source(tables["parquet folder"])
    assert isinstance(source, TableSource) and source.rows == 24
    batches = record_batches(source, batch_rows=4)
    first, batch = next(batches)
    assert (first, batch.num_rows) == (0, 4)
    shutil.rmtree(tables["parquet folder"])  # later shards are opened only when reached
    with pytest.raises(DataError, match="cannot read .*part-00001.parquet"):
        list(batches)


def test_the_pool_reads_only_a_few_batches_ahead(monkeypatch):
    class DonePool:
        def submit(self, fn, *args):
            f = Future()
            f.set_result(Tokenized())
            return f

    read = []

    def batches():
        for i in range(100):
            read.append(i)
            yield i, pa.record_batch({"input_ids": [[1, 2]]})

    out = pool.tokenized_batches(DonePool(), "x", batches(), threading.Event(), workers=2)
    next(out)
    assert len(read) == 2 * pool.BATCHES_AHEAD  # not all 100 batches in memory at once
    assert len(list(out)) == 99


def test_pool_and_background_load_give_the_in_process_result(tables, tok, monkeypatch):
    monkeypatch.setattr(loader, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(pool, "BATCHES_AHEAD", 1)
    want = load(tables["jsonl"], tok)
    same(load(tables["save_to_disk"], tok, tokenize_workers=2), want)
    with DataFuture(DataConfig(path=tables["parquet"], max_length=64, tokenize_workers=0), tok) as future:
        same(future.result(), want)


def test_regeneration_reads_table_conversations_by_index(tables, tmp_path):
    convs = [r for r in mixed_rows() if "input_ids" not in r]
    jsonl = write_jsonl(tmp_path / "c.jsonl", convs)
    dataset(convs).save_to_disk(str(tmp_path / "c"))
    want = load_conversations(DataConfig(path=jsonl)).conversations
    assert load_conversations(DataConfig(path=tmp_path / "c")).conversations == want
    with pytest.raises(DataError, match=r"all.parquet:2: this row is pre-tokenized"):
        load_conversations(DataConfig(path=tables["parquet"]))
    digest = source_digest(resolve_source(tmp_path / "c"))
    assert [name for name, _ in digest["files"]] == ["data-00000-of-00001.arrow"]
    convs[0] = {"messages": conv(("another", "answer"))}
    shutil.rmtree(tmp_path / "c")
    dataset(convs).save_to_disk(str(tmp_path / "c"))
    assert source_digest(resolve_source(tmp_path / "c"))["sha256"] != digest["sha256"]
    assert set(source_digest(resolve_source(jsonl))) == {"path", "bytes", "sha256"}  # as before tables


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A datasets cache holding ``org/chat_set`` as ``load_dataset("org/chat_set")`` leaves it online: built
    here by datasets' own parquet builder, moved to the id's cache folder; HF_HOME points at it."""
    rows = [r for r in mixed_rows() if "input_ids" not in r]
    pq.write_table(table(rows), tmp_path / "train.parquet")
    pq.write_table(table(rows[:3]), tmp_path / "test.parquet")
    root = tmp_path / "hf" / "datasets"
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.parquet")}
    Parquet(
        cache_dir=str(root), dataset_name="chat_set", hash="0123abcd", data_files=files
    ).download_and_prepare()
    (root / "org___chat_set").mkdir()
    shutil.move(glob.glob(str(root / "chat_set" / "default-*"))[0], root / "org___chat_set" / "default")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("a Hub id was looked up over the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return root


def test_a_cached_hub_id_resolves_offline(hub_cache, tmp_path, tok):
    convs = [r for r in mixed_rows() if "input_ids" not in r]
    want = load(write_jsonl(tmp_path / "c.jsonl", convs), tok)
    same(load("org/chat_set", tok), want)  # the train split by default
    assert len(load("org/chat_set:test", tok).samples) == 3
    assert len(load("org/chat_set:default:test", tok).samples) == 3
    source = resolve_source("org/chat_set")
    assert isinstance(source, TableSource) and all(str(f).startswith(str(hub_cache)) for f in source.files)


def test_an_uncached_hub_id_is_one_line_naming_id_cache_and_fix(hub_cache, tok):
    with pytest.raises(DataError) as info:
        load("org/missing", tok)
    text = str(info.value)
    assert text.startswith(
        "org/missing: the Hugging Face dataset org/missing is not in the local datasets cache"
    )
    assert str(hub_cache) in text and "never downloads" in text and "load_dataset('org/missing')" in text
    assert "\n" not in text
    with pytest.raises(
        DataError, match="org/chat_set:nope: the cached dataset org/chat_set has no such config"
    ):
        load("org/chat_set:nope", tok)


def test_a_hub_id_fetched_with_hf_download_resolves_from_the_hub_file_cache(hub_cache, tmp_path, tok):
    """``hf download --repo-type dataset org/files_set`` leaves its files under HF_HOME/hub, not in the
    datasets cache: the id resolves to its snapshot's parquet shards, per split, offline."""
    rows = [r for r in mixed_rows() if "input_ids" not in r]
    repo = tmp_path / "hf" / "hub" / "datasets--org--files_set"
    snapshot = repo / "snapshots" / "abc123"
    (snapshot / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    pq.write_table(table(rows[:4]), snapshot / "data" / "train-00000-of-00002.parquet")
    pq.write_table(table(rows[4:]), snapshot / "data" / "train-00001-of-00002.parquet")
    pq.write_table(table(rows[:2]), snapshot / "data" / "test-00000-of-00001.parquet")
    want = load(write_jsonl(tmp_path / "c.jsonl", rows), tok)
    same(load("org/files_set", tok), want)  # both train shards, in order
    assert len(load("org/files_set:test", tok).samples) == 2
    with pytest.raises(
        DataError, match=r"org/files_set:dev: the Hub file cache's snapshot .* has no split 'dev'"
    ):
        load("org/files_set:dev", tok)
    with pytest.raises(DataError) as info:
        load("org/missing", tok)
    assert str(tmp_path / "hf" / "hub") in str(info.value) and "hf download --repo-type dataset" in str(
        info.value
    )


def test_local_paths_are_not_taken_for_hub_ids(tmp_path, tok, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for missing in ("data/train", "org/train.parquet"):
        with pytest.raises(DataError, match=f"^{missing}: the data path does not exist"):
            load(missing, tok)
