"""JSONL/TensorBoard sinks, make_logger errors and read_metrics on a file still being written."""

import json
import math
import sys

import pytest

from dflash_pipe.telemetry import JsonlSink, MetricsLogger, make_logger, read_metrics


def test_jsonl_round_trip_with_lists_and_append_after_reopen(tmp_path):
    with make_logger(tmp_path / "metrics.jsonl") as logger:
        logger.log({"loss": 2.5, "tokens": 1024, "acc": [0.0, 0.75, 0.5]}, step=1)
        logger.log({"loss": 2.25, "acc": [0.0, 0.8, 0.6]}, step=2)
    # resumed run: a new logger on the same run dir continues the file
    with make_logger(tmp_path / "metrics.jsonl", kinds=("jsonl",)) as logger:
        logger.log({"loss": 2.0}, step=3)

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == 2.5 and rows[0]["tokens"] == 1024 and isinstance(rows[0]["tokens"], int)
    assert rows[0]["acc"] == [0.0, 0.75, 0.5]
    assert rows[1]["acc"] == [0.0, 0.8, 0.6]
    assert rows[2] == {"step": 3, "time": rows[2]["time"], "loss": 2.0}
    assert rows[0]["time"] <= rows[1]["time"] <= rows[2]["time"]
    assert abs(rows[0]["time"] - __import__("time").time()) < 60  # unix seconds


def test_each_line_is_flushed_while_open(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    logger = MetricsLogger([sink])
    logger.log({"loss": 1.0}, step=7)
    lines = path.read_text().splitlines()  # read by another reader before close
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 7
    logger.close()
    logger.close()  # idempotent


def test_nonfinite_values_become_null_strict_json(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLogger([JsonlSink(path)]) as logger:
        logger.log({"loss": math.nan, "acc": [1.0, math.inf]}, step=0)
    line = path.read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    row = json.loads(line)
    assert row["loss"] is None and row["acc"] == [1.0, None]


def test_read_metrics_tolerates_partial_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 0.0, "loss": 3.0}\n{"step": 2, "time": 1.0, "lo')
    rows = read_metrics(path)
    assert rows == [{"step": 1, "time": 0.0, "loss": 3.0}]


def test_read_metrics_rejects_corrupt_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)


def test_resume_after_crash_drops_partial_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 0.0, "loss": 3.0}\n{"step": 2, "ti')  # writer killed mid-line
    with MetricsLogger([JsonlSink(path)]) as logger:
        logger.log({"loss": 2.5}, step=2)
    rows = read_metrics(path)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 3.0), (2, 2.5)]


def test_unknown_sink_kind_names_it_and_creates_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"unknown metrics sink kind 'csv'.*jsonl, tensorboard, wandb"):
        make_logger(tmp_path / "run" / "metrics.jsonl", kinds=("jsonl", "csv"))
    assert not (tmp_path / "run").exists()


def test_kinds_as_plain_string_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="sequence of sink names"):
        make_logger(tmp_path / "metrics.jsonl", kinds="jsonl")


@pytest.mark.parametrize(
    ("metrics", "match"),
    [
        ({"step": 1.0}, "reserved"),
        ({"loss": "high"}, "must be a float, int or list"),
        ({"acc": [0.1, "x"]}, "list of numbers"),
    ],
)
def test_bad_metrics_raise_naming_the_key(tmp_path, metrics, match):
    with make_logger(tmp_path / "metrics.jsonl") as logger, pytest.raises(ValueError, match=match):
        logger.log(metrics, step=0)
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_missing_wandb_names_pip_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install wandb"):
        make_logger(tmp_path / "metrics.jsonl", kinds=("wandb",))


def test_missing_tensorboard_names_pip_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install tensorboard"):
        make_logger(
            tmp_path / "metrics.jsonl", kinds=("tensorboard",), tensorboard_dir=tmp_path / "tensorboard"
        )


def test_tensorboard_sink_writes_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with make_logger(
        tmp_path / "metrics.jsonl", kinds=("tensorboard",), tensorboard_dir=tmp_path / "tensorboard"
    ) as logger:
        logger.log({"loss": 1.5, "acc": [0.0, 0.5, 0.25]}, step=3)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "acc/slot_0", "acc/slot_1", "acc/slot_2"} <= tags
    (ev,) = acc.Scalars("acc/slot_1")
    assert ev.step == 3 and ev.value == pytest.approx(0.5)
    assert (tmp_path / "metrics.jsonl").exists()  # JSONL is always written


def test_tensorboard_without_a_folder_is_refused_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match="needs a folder to write into: pass tensorboard_dir"):
        make_logger(tmp_path / "metrics.jsonl", kinds=("tensorboard",))
    assert not (tmp_path / "metrics.jsonl").exists()
