"""The regenerated file: provenance, reuse, torn-line recovery, and that it trains as ordinary data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_helpers import conv

from dflash_pipe.data import DataConfig, DataError, load_samples
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.conversations import load_conversations
from dflash_pipe.data.regenerated import (
    Regenerated,
    RegenFileError,
    RegenStore,
    RegenTally,
    TurnFailure,
    provenance,
)
from dflash_pipe.data.render import render_conversation


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    (d / "model.safetensors").write_bytes(b"x" * 10)
    return d


def _records() -> list[Regenerated]:
    return [
        Regenerated(index=0, messages=conv(("q0", "target a0")), turns=1, new_tokens=5),
        Regenerated(
            index=1,
            messages=conv(("q1", "target a1")),
            turns=1,
            new_tokens=4,
            failed=TurnFailure(turn=1, reason="prompt too long", skipped_turns=2),
        ),
        Regenerated(index=2, messages=[], failed=TurnFailure(turn=0, reason="empty reply", skipped_turns=1)),
    ]


def _prov(target_dir: Path, data: Path, **settings) -> dict:
    return provenance(target_dir, DataConfig(path=data), RegenConfig(**settings))


def test_records_round_trip_and_reopen_reuses_them(tmp_path, target_dir, write_jsonl):
    data = write_jsonl([{"messages": conv(("q", "a"))}])
    path = tmp_path / "regen.jsonl"
    store = RegenStore(path, _prov(target_dir, data))
    store.append(_records())
    store.close()
    again = RegenStore(path, _prov(target_dir, data))
    assert sorted(again.done) == [0, 1, 2]
    assert again.done[1].failed == TurnFailure(turn=1, reason="prompt too long", skipped_turns=2)
    assert again.done[0].messages == conv(("q0", "target a0"))
    again.close()


def test_a_torn_last_line_is_cut_and_the_rest_kept(tmp_path, target_dir, write_jsonl):
    data = write_jsonl([{"messages": conv(("q", "a"))}])
    path = tmp_path / "regen.jsonl"
    store = RegenStore(path, _prov(target_dir, data))
    store.append(_records()[:2])
    store.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"messages": [{"role": "user", "con')  # killed mid-write
    reopened = RegenStore(path, _prov(target_dir, data))
    assert sorted(reopened.done) == [0, 1] and reopened.torn_bytes > 0
    assert path.read_bytes() == whole
    reopened.append(_records()[2:])
    reopened.close()
    assert sorted(RegenStore(path, _prov(target_dir, data)).done) == [0, 1, 2]


def test_other_settings_source_or_target_are_refused(tmp_path, target_dir, write_jsonl):
    data = write_jsonl([{"messages": conv(("q", "a"))}])
    path = tmp_path / "regen.jsonl"
    RegenStore(path, _prov(target_dir, data)).close()
    with pytest.raises(RegenFileError, match="another settings .*temperature: file has 0.0, this run 0.7"):
        RegenStore(path, _prov(target_dir, data, temperature=0.7))
    other = write_jsonl([{"messages": conv(("q", "b"))}], name="other.jsonl")
    with pytest.raises(RegenFileError, match="another source"):
        RegenStore(path, _prov(target_dir, other))
    (target_dir / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(RegenFileError, match="another target"):
        RegenStore(path, _prov(target_dir, data))
    # batch size does not change what is generated: the file is reused
    (target_dir / "config.json").write_text('{"model_type": "qwen3"}')
    RegenStore(path, _prov(target_dir, data, batch_size=3)).close()


def test_a_file_that_is_not_a_regenerated_file_is_refused(tmp_path, target_dir, write_jsonl):
    data = write_jsonl([{"messages": conv(("q", "a"))}])
    with pytest.raises(RegenFileError, match="not a regenerated-conversations file"):
        RegenStore(data, _prov(target_dir, data))


def test_the_regenerated_file_trains_as_ordinary_data(tmp_path, target_dir, write_jsonl, tok):
    data = write_jsonl([{"messages": conv(("q", "a"))}])
    path = tmp_path / "regen.jsonl"
    store = RegenStore(path, _prov(target_dir, data))
    store.append(_records())
    store.close()
    loaded = load_samples(DataConfig(path=path, min_loss_tokens=0), tok)
    assert loaded.skipped_lines == 0 and len(loaded.samples) == 2  # header and the empty one skipped
    assert loaded.drop_reasons == {"not regenerated": 1}  # the empty one is counted, the header is not
    ids, _ = render_conversation(tok, conv(("q0", "target a0")))
    assert loaded.samples[0].input_ids.tolist() == ids
    assert [m["content"] for m in load_conversations(DataConfig(path=path)).conversations[1]] == [
        "q1",
        "target a1",
    ]


def test_pretokenized_lines_cannot_be_regenerated(write_jsonl):
    data = write_jsonl([{"messages": conv(("q", "a"))}, {"input_ids": [1, 2], "loss_mask": [0, 1]}])
    with pytest.raises(DataError, match=r"data.jsonl:2: this line is pre-tokenized .* --responses dataset"):
        load_conversations(DataConfig(path=data))


def test_bad_lines_are_counted_with_skip_bad_lines(write_jsonl):
    data = write_jsonl([{"messages": conv(("q", "a"))}, "not json", {"messages": []}, {"text": "x"}])
    with pytest.raises(DataError, match="data.jsonl:2: not JSON"):
        load_conversations(DataConfig(path=data))
    got = load_conversations(DataConfig(path=data, skip_bad_lines=True))
    assert len(got.conversations) == 1 and got.skip_reasons == {"not JSON": 1, "wrong schema": 1}
    assert got.drop_reasons == {"empty conversation": 1}  # left out without --skip-bad-lines too


def test_tally_counts_failed_and_skipped_turns():
    tally = RegenTally()
    for record in _records():
        tally.add(record)
    assert tally.conversations == 3 and tally.turns == 2 and tally.new_tokens == 9
    assert dict(tally.failed) == {"prompt too long": 1, "empty reply": 1}
    assert tally.skipped_turns == 3 and tally.dropped == 1
    assert tally.failed_text() == "1 empty reply, 1 prompt too long"


def test_chat_template_kwargs_are_validated():
    with pytest.raises(ValueError, match="chat_template_kwargs must be a mapping"):
        DataConfig(path=Path("x"), chat_template_kwargs=["enable_thinking"])
    with pytest.raises(ValueError, match="data.responses must be dataset or target|responses must be"):
        DataConfig(path=Path("x"), responses="model")
    assert json.dumps(
        DataConfig(path=Path("x"), chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs
    )


def test_a_file_whose_every_prompt_is_too_long_stops_before_regenerating(write_jsonl, tok):
    """No conversation leaves room under max_length for a reply to train: one line naming the shortest
    prompt and the length that fits it, before anything is generated."""
    from dflash_pipe.data.conversations import check_prompts_fit
    from dflash_pipe.data.render import render_prompt

    rows = [conv(("a much longer question than the other one, " * 3, "x")), conv(("short?", "y"), ("z", "w"))]
    data = write_jsonl([{"messages": r} for r in rows])
    source = load_conversations(DataConfig(path=data))
    lengths = [len(tok(render_prompt(tok, r[:1], {}), add_special_tokens=False)["input_ids"]) for r in rows]
    shortest = min(lengths)
    assert lengths[1] == shortest < lengths[0]
    cfg = DataConfig(path=data, max_length=shortest + 2)  # a reply needs min_loss_tokens + 1 = 3 tokens
    with pytest.raises(DataError) as info:
        check_prompts_fit(source, tok, cfg)
    assert str(info.value) == (
        f"no sample of {data} fits --max-length {shortest + 2}: the shortest first prompt is {shortest} "
        f"tokens; raise --max-length (data.max_length) to at least {shortest + 3} (a prompt needs room for "
        "a reply of 3 tokens to train)"
    )
    check_prompts_fit(source, tok, DataConfig(path=data, max_length=shortest + 3))  # one fits: no error


def test_capped_and_looped_counts_round_trip_and_old_lines_read_as_zero(tmp_path, target_dir, write_jsonl):
    record = Regenerated(index=4, messages=conv(("q", "a a a")), turns=1, truncated=1, capped=1, looped=1)
    line = record.to_line()
    assert line["regen"]["capped"] == 1 and line["regen"]["looped"] == 1
    assert Regenerated.from_line(json.loads(json.dumps(line))) == record
    del line["regen"]["capped"], line["regen"]["looped"]  # a file written before they were counted
    old = Regenerated.from_line(line)
    assert (old.capped, old.looped) == (0, 0)
    tally = RegenTally()
    tally.add(record)
    assert (tally.capped_turns, tally.looped_turns) == (1, 1)


def test_dropping_loops_is_part_of_the_provenance_keeping_them_is_not(tmp_path, target_dir, write_jsonl):
    """A file made before --regen-loops existed is a "keep" file: still reused; a "drop" file is not."""
    data = write_jsonl([{"messages": conv(("q", "a"))}])
    keep = _prov(target_dir, data)
    assert "loops" not in keep["settings"]
    assert _prov(target_dir, data, loops="drop")["settings"]["loops"] == "drop"
    path = tmp_path / "regen.jsonl"
    RegenStore(path, keep).close()
    with pytest.raises(RegenFileError, match="loops: file has None, this run 'drop'"):
        RegenStore(path, _prov(target_dir, data, loops="drop"))
    with pytest.raises(ValueError, match="regen.loops must be keep or drop, got 'trim'"):
        RegenConfig(loops="trim")
