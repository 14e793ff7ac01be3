"""The tokenization pool and the background load give exactly the in-process result, errors included."""

from __future__ import annotations

import json
import multiprocessing

import pytest
from data_helpers import DyingVocab, SlowVocab, conv

from dflash_pipe.data import DataConfig, DataError, DataFuture, LoadedData, load_samples, loader, pool
from dflash_pipe.data.lines import LoadCancelled

PIECE = 512
"""Bytes per piece in these tests (the real minimum is 64 KiB), so a small file has many pieces."""


@pytest.fixture
def pooled(monkeypatch):
    """Files of any size go to the pool, cut into PIECE-byte pieces."""
    monkeypatch.setattr(loader, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(pool, "MIN_PIECE_BYTES", PIECE)
    monkeypatch.setattr(pool, "MAX_PIECE_BYTES", PIECE)


def mixed_rows(n: int) -> list:
    """Conversations of varied length, pre-tokenized lines, blank lines, bad lines and short samples."""
    rows: list = []
    for i in range(n):
        kind = i % 7
        if kind == 0:
            rows.append({"messages": conv((f"question {i} " * (1 + i % 5), f"answer {i} " * (1 + i % 9)))})
        elif kind == 1:
            rows.append({"input_ids": list(range(1, 4 + i % 30)), "loss_mask": [1] * (3 + i % 30)})
        elif kind == 2:
            rows.append("")  # blank
        elif kind == 3:
            rows.append("{not json" if i % 2 else json.dumps({"messages": []}))
        elif kind == 4:
            rows.append({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1]})  # no anchor: dropped
        elif kind == 5:
            rows.append(
                {"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": "yo"}]}
            )
        else:
            rows.append({"input_ids": list(range(1, 60)), "loss_mask": [0] * 10 + [1] * 49})  # truncated
    return rows


def same(a: LoadedData, b: LoadedData) -> None:
    assert [s.sample_id for s in a.samples] == [s.sample_id for s in b.samples] == list(range(len(a.samples)))
    assert [s.input_ids.tolist() for s in a.samples] == [s.input_ids.tolist() for s in b.samples]
    assert [s.loss_mask.tolist() for s in a.samples] == [s.loss_mask.tolist() for s in b.samples]
    assert all(s.input_ids.dtype == t.input_ids.dtype for s, t in zip(a.samples, b.samples, strict=True))
    assert all(s.loss_mask.dtype == t.loss_mask.dtype for s, t in zip(a.samples, b.samples, strict=True))
    assert (a.skipped_lines, a.truncated, a.dropped_short, a.skip_reasons) == (
        b.skipped_lines,
        b.truncated,
        b.dropped_short,
        b.skip_reasons,
    )


def error_of(cfg: DataConfig, tok) -> str:
    with pytest.raises(DataError) as info:
        load_samples(cfg, tok)
    return str(info.value)


def test_split_lines_covers_the_file_at_line_ends(write_jsonl):
    path = write_jsonl(mixed_rows(60))
    data = path.read_bytes()
    pieces = list(pool.split_lines(path, 100))
    assert len(pieces) > 5
    assert pieces[0].start == 0 and pieces[-1].end == len(data)
    for a, b in zip(pieces, pieces[1:], strict=False):
        assert a.end == b.start and data[a.end - 1 : a.end] == b"\n"
        assert b.first_line == 1 + data[: b.start].count(b"\n")


def test_pool_equals_in_process(tok, write_jsonl, pooled):
    """One pool run against the in-process pass: ids, masks, dense sample ids, skips per reason,
    truncation and short-sample drops, over many pieces (and a file without a final newline)."""
    path = write_jsonl(mixed_rows(120))
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # the last line has no newline
    assert len(list(pool.split_lines(path, PIECE))) >= 8
    kw = {"path": path, "skip_bad_lines": True, "max_length": 40, "min_loss_tokens": 2}
    serial = load_samples(DataConfig(**kw, tokenize_workers=1), tok)
    parallel = load_samples(DataConfig(**kw, tokenize_workers=2), tok, progress=True)  # bar per piece
    same(serial, parallel)
    assert serial.skipped_lines > 0 and serial.truncated > 0 and serial.dropped_short > 0
    assert multiprocessing.active_children() == []  # the pool's processes are gone


def test_pool_reports_the_first_bad_line_like_in_process(tok, write_jsonl, pooled):
    """Without skip_bad_lines the error is the serial one (FILE:LINE: reason. fix), for the first bad line
    of the file even when later pieces have bad lines too; the pool is shut down."""
    rows = [{"messages": conv(("q", "a"))}] * 50
    rows[33] = "{not json"  # line 34, a few pieces into the file
    rows[45] = json.dumps({"messages": []})
    path = write_jsonl(rows)
    serial = error_of(DataConfig(path=path, tokenize_workers=0), tok)
    assert serial.startswith(f"{path}:34: not JSON:")
    assert error_of(DataConfig(path=path, tokenize_workers=2), tok) == serial
    assert multiprocessing.active_children() == []


def test_background_load_hands_over_result_and_error(tok, write_jsonl, pooled):
    """DataFuture.result() is load_samples' result, or raises its DataError (here from a pool worker)."""
    good = write_jsonl(mixed_rows(40), name="good.jsonl")
    cfg = DataConfig(path=good, skip_bad_lines=True, tokenize_workers=0)
    with DataFuture(cfg, tok) as future:
        same(future.result(), load_samples(cfg, tok))
    t = type(tok).from_pretrained(tok.name_or_path)
    t.chat_template = None  # a tokenizer problem, raised inside a worker
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}] * 40 + [{"messages": conv(("q", "a"))}]
    bad = write_jsonl(rows, name="bad.jsonl")
    expected = error_of(DataConfig(path=bad, tokenize_workers=0), t)
    assert expected.startswith(
        f"{bad}:41: this line is a conversation, but the tokenizer has no chat template"
    )
    future = DataFuture(DataConfig(path=bad, tokenize_workers=2), t)
    with pytest.raises(DataError) as info:
        future.result()
    assert str(info.value) == expected
    future.close()
    future.close()  # twice is fine
    assert multiprocessing.active_children() == []


def test_close_stops_a_running_pool(write_jsonl, pooled):
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}] * 400  # ~40 pieces of 0.2 s each
    future = DataFuture(DataConfig(path=write_jsonl(rows), tokenize_workers=2), SlowVocab(0.2))
    future.close()
    with pytest.raises(LoadCancelled, match="the run stopped waiting for it"):
        future.result()
    assert multiprocessing.active_children() == []


def test_close_stops_an_in_process_load(write_jsonl):
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}] * 50
    future = DataFuture(DataConfig(path=write_jsonl(rows), tokenize_workers=0), SlowVocab(0.5))
    future.close()  # the in-process pass checks between lines; len() is taken before the first
    with pytest.raises(LoadCancelled):
        future.result()


def test_worker_count(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "usable_cpus", lambda: 8)
    big, small = loader.POOL_MIN_BYTES, loader.POOL_MIN_BYTES - 1
    assert loader.tokenize_workers(DataConfig(path=tmp_path), big) == 7
    assert loader.tokenize_workers(DataConfig(path=tmp_path), small) == 0
    assert loader.tokenize_workers(DataConfig(path=tmp_path, tokenize_workers=3), big) == 3
    for n in (0, 1):
        assert loader.tokenize_workers(DataConfig(path=tmp_path, tokenize_workers=n), big) == 0
    monkeypatch.setattr(loader, "usable_cpus", lambda: 64)
    assert loader.tokenize_workers(DataConfig(path=tmp_path), big) == loader.MAX_AUTO_WORKERS
    with pytest.raises(ValueError, match="DataConfig.tokenize_workers must be >= 0"):
        DataConfig(path=tmp_path, tokenize_workers=-1)
    assert pool.piece_bytes(10 << 30, 4) == pool.MAX_PIECE_BYTES
    assert pool.piece_bytes(1000, 4) == pool.MIN_PIECE_BYTES


def test_a_dead_worker_is_a_data_error(write_jsonl, pooled):
    path = write_jsonl([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}] * 100)
    with pytest.raises(
        DataError, match=f"^{path}: a tokenization worker process died .* --tokenize-workers 1"
    ):
        load_samples(DataConfig(path=path, tokenize_workers=2), DyingVocab())
    assert multiprocessing.active_children() == []
