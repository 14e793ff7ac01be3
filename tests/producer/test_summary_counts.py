"""What the end-of-run summary and metrics.jsonl say about the data and the steps: every skipped line and
dropped sample counted by reason, the note when nothing could be held out, and a resumed launch's own steps."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from dflash_pipe.data import LoadedData
from dflash_pipe.producer.display import data_lines, data_metrics, data_report, summary
from dflash_pipe.report import print_summary, steps_text
from tests.producer.test_core import _core

NOTE = "d.jsonl has 4 sample(s), too few to hold out an eval set (...): no held-out set, so no tau"


def _counted_core(tmp_path: Path):
    core, _, _ = _core(tmp_path)
    core.ctx.data = LoadedData(
        samples=[],
        skipped_lines=3,
        truncated=2,
        dropped_short=2,
        skip_reasons={"not JSON": 2, "ids >= vocab size": 1},
        drop_reasons={"empty assistant turns": 1, "too long for max_length": 1, "not regenerated": 4},
    )
    core.ctx.notes = [NOTE]
    return core


def test_every_skipped_line_and_dropped_sample_is_counted_by_reason(tmp_path: Path) -> None:
    core = _counted_core(tmp_path)
    report = data_report(core)
    assert report["samples"] == 4 and report["held_out"] == 0 and report["truncated"] == 2
    assert data_metrics(report) == {
        "data/samples": 4.0,
        "data/held_out": 0.0,
        "data/truncated": 2.0,
        "data/skipped": 3.0,
        "data/skipped/not_json": 2.0,
        "data/skipped/ids_vocab_size": 1.0,
        "data/dropped": 6.0,
        "data/dropped/empty_assistant_turns": 1.0,
        "data/dropped/too_long_for_max_length": 1.0,
        "data/dropped/not_regenerated": 4.0,
    }
    line, note = data_lines(report)
    assert line == (
        f"data: 4 training samples, 0 held out, from {tmp_path / 'd.jsonl'}; bad lines skipped: 3 (1 ids >= "
        "vocab size, 2 not JSON); samples dropped: 6 (1 empty assistant turns, 4 not regenerated, 1 too long "
        "for max_length); 2 cut to --max-length 3072"
    )
    assert note == f"note: {NOTE}"


def test_nothing_left_out_says_none(tmp_path: Path) -> None:
    core, _, _ = _core(tmp_path)
    [line] = data_lines(data_report(core))
    assert "bad lines skipped: none; samples dropped: none; 0 cut to" in line


def test_the_summary_counts_the_steps_of_this_launch(tmp_path: Path) -> None:
    core = _counted_core(tmp_path)
    core.ctx.resume_step, core.account.step = 100, 140
    resumed = summary(core, stop_reason="finished", wall_s=10.0, busy={})
    assert resumed.launch_steps == 40 and resumed.data == data_report(core)
    assert steps_text(resumed) == "trained 40 steps this launch (step 100 -> 140)"
    core.ctx.resume_step, core.account.step = 0, 1
    assert steps_text(summary(core, stop_reason="finished", wall_s=1.0, busy={})) == "1 step"
    core.ctx.resume_step, core.account.step = 140, 141
    assert steps_text(summary(core, stop_reason="x", wall_s=1.0, busy={})).startswith("trained 1 step this")


def test_the_printed_summary_has_the_steps_the_data_and_the_note(tmp_path: Path) -> None:
    core = _counted_core(tmp_path)
    core.ctx.resume_step, core.account.step = 100, 140
    (tmp_path / "metrics.jsonl").write_text("")
    console = Console(record=True, width=400)
    print_summary(tmp_path, summary(core, stop_reason="finished", wall_s=10.0, busy={}), console)
    text = console.export_text()
    assert "trained 40 steps this launch (step 100 -> 140) in 10 s" in text
    assert (
        "samples dropped: 6 (1 empty assistant turns, 4 not regenerated, 1 too long for max_length)" in text
    )
    assert f"note: {NOTE}" in text
