"""load_samples: formats, bad lines (raise or skip and count), truncation, short samples, file errors."""

from __future__ import annotations

import json

import pytest
import torch
from data_helpers import conv

from dflash_pipe.data import DataConfig, DataError, LoadedData, load_samples
from dflash_pipe.data.demo import demo_pretokenized_path, demo_sharegpt_path

GOOD = {"messages": conv(("What is 1 plus 1?", "1 plus 1 is 2."))}

BAD_LINES = [  # (line, reason named in the error)
    ("{not json", "not JSON"),
    ("[1, 2]", "wrong schema"),
    (json.dumps({"text": "hello"}), "wrong schema"),
    (
        json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}),
        "wrong schema",
    ),
    (json.dumps({"conversations": [{"from": "human", "text": "x"}]}), "wrong schema"),
    (json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}), "length mismatch"),
    (json.dumps({"input_ids": [1, 2.5, 3], "loss_mask": [0, 1, 1]}), "non-int ids"),
    (json.dumps({"input_ids": [1, "2", 3], "loss_mask": [0, 1, 1]}), "non-int ids"),
    (json.dumps({"input_ids": [1, 99999, 3], "loss_mask": [0, 1, 1]}), "ids >= vocab size"),
    (json.dumps({"input_ids": [1, -1, 3], "loss_mask": [0, 1, 1]}), "negative ids"),
    (json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}), "bad loss_mask"),
    (json.dumps({"input_ids": [1, 2, 3]}), "wrong schema"),
    (json.dumps({"input_ids": [], "loss_mask": []}), "empty input_ids"),
]


def test_pretokenized_passthrough(tok, write_jsonl):
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 1, 0]},
        {"input_ids": [10, 11, 12], "loss_mask": [True, True, True]},
    ]
    data = load_samples(DataConfig(path=write_jsonl(rows)), tok)
    assert [s.sample_id for s in data.samples] == [0, 1]
    for s, r in zip(data.samples, rows, strict=True):
        assert s.input_ids.dtype == torch.int64 and s.loss_mask.dtype == torch.bool
        assert s.input_ids.tolist() == r["input_ids"]
        assert s.loss_mask.tolist() == [bool(m) for m in r["loss_mask"]]
    assert data.lengths() == [5, 3]


def test_bundled_pretokenized_equals_rendered_sharegpt(tok):
    a = load_samples(DataConfig(path=demo_pretokenized_path()), tok).samples
    b = load_samples(DataConfig(path=demo_sharegpt_path()), tok).samples
    assert [s.input_ids.tolist() for s in a] == [s.input_ids.tolist() for s in b]
    assert [s.loss_mask.tolist() for s in a] == [s.loss_mask.tolist() for s in b]


def test_pretokenized_needs_no_tokenizer(write_jsonl):
    data = load_samples(
        DataConfig(path=write_jsonl([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}])), None
    )
    assert data.lengths() == [3]


def test_mixed_formats_and_blank_lines(tok, write_jsonl):
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "What is 1 plus 1?"},
            {"from": "gpt", "value": "1 plus 1 is 2."},
        ]
    }
    path = write_jsonl([GOOD, "", "   ", sharegpt, {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}])
    data = load_samples(DataConfig(path=path), tok)
    assert [s.sample_id for s in data.samples] == [0, 1, 2]
    assert data.samples[0].input_ids.tolist() == data.samples[1].input_ids.tolist()
    assert data.skipped_lines == 0


@pytest.mark.parametrize(("line", "reason"), BAD_LINES)
def test_bad_line_names_file_line_and_reason(tok, write_jsonl, line, reason):
    path = write_jsonl([GOOD, GOOD, line, GOOD])
    with pytest.raises(DataError) as e:
        load_samples(DataConfig(path=path), tok)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: {reason}:"), msg
    assert "\n" not in msg and msg.count(". ") >= 1  # one line: reason, then the fix


def test_skip_bad_lines_counts_per_reason(tok, write_jsonl):
    rows = [GOOD] + [line for line, _ in BAD_LINES] + [GOOD]
    data = load_samples(DataConfig(path=write_jsonl(rows), skip_bad_lines=True), tok)
    assert isinstance(data, LoadedData)
    assert len(data.samples) == 2 and [s.sample_id for s in data.samples] == [0, 1]
    assert data.skipped_lines == len(BAD_LINES)
    expected: dict[str, int] = {}
    for _, reason in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert data.skip_reasons == expected


def test_truncation_and_short_samples_are_counted(tok, write_jsonl):
    rows = [
        {"input_ids": list(range(1, 21)), "loss_mask": [1] * 20},  # truncated to 8
        {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1]},  # no two adjacent trained: 0 anchors
        {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 0]},  # 1 anchor position
        {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]},  # 2 anchor positions
        {"input_ids": list(range(1, 12)), "loss_mask": [0] * 9 + [1, 1]},  # trained tail cut off -> dropped
    ]
    data = load_samples(DataConfig(path=write_jsonl(rows), max_length=8, min_loss_tokens=2), tok)
    assert data.truncated == 2
    assert data.dropped_short == 3
    assert [s.input_ids.tolist() for s in data.samples] == [list(range(1, 9)), [1, 2, 3, 4]]
    assert data.samples[0].loss_mask.tolist() == [True] * 8
    assert [s.sample_id for s in data.samples] == [0, 1]


def test_dropped_samples_are_counted_by_reason(tok, write_jsonl):
    rows = [
        GOOD,
        {"messages": conv(("Say nothing.", ""))},  # every assistant turn empty
        {"messages": conv(("Say nothing.", " "), ("Again.", ""))},
        {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1]},  # too few trainable positions at any length
        {"input_ids": list(range(1, 61)), "loss_mask": [0] * 40 + [1] * 20},  # would train; the cut drops it
        {"dflash_pipe": {"regenerated": {"version": 1}}},  # a regenerated file's header: not a sample
        {"dflash_pipe": {"index": 3, "failed": {"turn": 0, "reason": "empty reply", "skipped_turns": 1}}},
    ]
    data = load_samples(DataConfig(path=write_jsonl(rows), max_length=40), tok)
    assert len(data.samples) == 1
    assert data.drop_reasons == {
        "empty assistant turns": 2,
        "too few trainable tokens": 1,
        "too long for max_length": 1,
        "not regenerated": 1,
    }
    assert data.dropped_short == 4 and data.truncated == 1


def test_no_sample_that_fits_max_length_names_the_shortest(tok, write_jsonl):
    rows = [
        {"input_ids": list(range(1, 31)), "loss_mask": [0] * 25 + [1] * 5},
        {"input_ids": list(range(1, 21)), "loss_mask": [0] * 15 + [1] * 5},
        {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]},  # would train at no length: not the shortest
    ]
    path = write_jsonl(rows)
    with pytest.raises(DataError) as info:
        load_samples(DataConfig(path=path, max_length=12), tok)
    assert str(info.value) == (
        f"no sample of {path} fits --max-length 12: the shortest sample is 20 tokens; raise --max-length "
        "(data.max_length) to at least 20"
    )
    assert len(load_samples(DataConfig(path=path, max_length=20), tok).samples) == 1


def test_conversation_truncation(tok, write_jsonl):
    full = load_samples(DataConfig(path=write_jsonl([GOOD])), tok).samples[0]
    cut = load_samples(DataConfig(path=write_jsonl([GOOD]), max_length=len(full.input_ids) - 3), tok)
    assert cut.truncated == 1
    assert cut.samples[0].input_ids.tolist() == full.input_ids.tolist()[:-3]
    assert cut.samples[0].loss_mask.tolist() == full.loss_mask.tolist()[:-3]


def test_missing_file_and_directory(tmp_path, tok):
    cases = [
        (tmp_path / "nope.jsonl", "the data path does not exist. Pass a JSONL file"),
        (tmp_path, "the folder has no .parquet or .arrow files"),  # an empty folder: no shards in it
    ]
    for path, what in cases:
        with pytest.raises(DataError, match=f"^{path}: {what}"):
            load_samples(DataConfig(path=path), tok)


def test_empty_file_and_no_usable_samples(tok, write_jsonl):
    for rows, kw in [
        ([], {}),
        (["", ""], {}),
        (["{bad"], {"skip_bad_lines": True}),
        ([GOOD], {"min_loss_tokens": 10_000}),
    ]:
        path = write_jsonl(rows)
        with pytest.raises(DataError, match=f"^{path}: no usable samples"):
            load_samples(DataConfig(path=path, **kw), tok)


def test_tokenizer_without_chat_template(tok, write_jsonl):
    t = type(tok).from_pretrained(tok.name_or_path)
    t.chat_template = None
    path = write_jsonl([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}, GOOD])
    # even with skip_bad_lines: a tokenizer problem is not a bad line
    with pytest.raises(
        DataError, match=f"^{path}:2: this line is a conversation, but the tokenizer has no chat template"
    ):
        load_samples(DataConfig(path=path, skip_bad_lines=True), t)
    with pytest.raises(DataError, match="no tokenizer was given"):
        load_samples(DataConfig(path=path), None)
    assert load_samples(
        DataConfig(path=write_jsonl([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}])), t
    ).lengths() == [3]


def test_progress_bar_runs(tok, write_jsonl, capsys):
    data = load_samples(DataConfig(path=write_jsonl([GOOD] * 5)), tok, progress=True)
    assert len(data.samples) == 5


def test_config_validation(tmp_path):
    assert DataConfig(path=str(tmp_path)).path == tmp_path
    for kw, field in [
        ({"max_length": 1}, "max_length"),
        ({"token_budget": 0}, "token_budget"),
        ({"min_loss_tokens": -1}, "min_loss_tokens"),
    ]:
        with pytest.raises(ValueError, match=f"DataConfig.{field}"):
            DataConfig(path=tmp_path, **kw)


def test_unreadable_file_names_the_file_and_the_fix(tok, write_jsonl, monkeypatch):
    path = write_jsonl([GOOD])

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("dflash_pipe.data.lines.open", denied, raising=False)  # root ignores chmod 000
    with pytest.raises(DataError, match=f"^{path}: cannot read the data file \\(Permission denied\\). Check"):
        load_samples(DataConfig(path=path), tok)
