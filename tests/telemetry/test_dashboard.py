"""Dashboard plain/live modes on an in-memory console, sparkline, and the end-of-run summary table."""

import io

import pytest
from rich.console import Console

from dflash_pipe.telemetry import Dashboard, RunState, sparkline, summary_table


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _state(step: int, loss: float, **kw) -> RunState:
    return RunState(
        step=step,
        epoch=0,
        progress=step / 100,
        elapsed_s=step * 2.0,
        eta_s=(100 - step) * 2.0,
        tokens_per_s={"producer": 12_300.0, "wire": 12_100.0, "drafters": 11_900.0},
        queue_depth=3,
        leased=8,
        workers=[
            {
                "name": "w1",
                "rank": 1,
                "device": "cuda:1",
                "state": "training",
                "steps": step,
                "first_step_s": 41.5,
            },
            {
                "name": "w0",
                "rank": 0,
                "device": "cuda:0",
                "state": "compiling",
                "steps": 0,
                "first_step_s": None,
            },
        ],
        loss=loss,
        acc=[0.8, 0.6, 0.4],
        lr=6e-4,
        **kw,
    )


def _lines(buf: io.StringIO) -> list[str]:
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()]


def test_plain_mode_rate_limited_and_final_line_on_close():
    buf = io.StringIO()
    clock = FakeClock()
    console = Console(file=buf, width=200)
    assert not console.is_terminal
    dash = Dashboard("demo", total_steps=100, console=console, plain_every_s=10.0, clock=clock)
    assert dash.live is False  # live=None and not a terminal -> plain
    for t, step in [(0.0, 1), (3.0, 2), (9.9, 3), (10.0, 4), (12.0, 5), (15.0, 6)]:
        clock.t = t
        dash.update(_state(step, loss=5.0 - step * 0.1))
    lines = _lines(buf)
    assert len(lines) == 2
    assert lines[0].startswith("[demo] step 1/100 ") and "step 4/100" in lines[1]
    clock.t = 16.0
    dash.close()
    lines = _lines(buf)
    assert len(lines) == 3 and "step 6/100" in lines[2]  # last state always printed on close
    line = lines[2]
    assert "loss 4.4000" in line and "acc 0.600" in line  # mean of the logged slots 1..3
    assert "tok/s producer 12.3k wire 12.1k drafters 11.9k" in line
    assert "queue 3 leased 8" in line and "workers 1/2 training" in line
    assert "eta 3:08" in line
    dash.close()  # idempotent
    assert len(_lines(buf)) == 3


def test_plain_mode_close_does_not_repeat_printed_line_and_prints_messages_at_once():
    buf = io.StringIO()
    clock = FakeClock()
    with Dashboard("demo", None, live=False, console=Console(file=buf, width=200), clock=clock) as dash:
        dash.update(_state(1, 3.0, messages=["worker w2 left"]))
        clock.t = 1.0
        dash.update(_state(1, 3.0, messages=["worker w2 left", "slow wire"]))
    lines = _lines(buf)
    assert lines[0] == "[demo] worker w2 left"
    assert lines[1].startswith("[demo] step 1 ")  # total_steps None: no "/total"
    assert lines[2] == "[demo] slow wire"
    assert len(lines) == 4  # the latest state (not printed yet) on close
    assert sum("worker w2 left" in ln for ln in lines) == 1


def test_live_mode_renders_to_terminal_console():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=140)
    with Dashboard("demo-run", total_steps=100, console=console) as dash:
        assert dash.live is True  # live=None and a terminal -> rich Live
        for step in range(1, 6):
            dash.update(
                _state(
                    step,
                    loss=4.0 - step * 0.5,
                    tau=3.25 if step == 5 else None,
                    real_tau=2.5 if step == 5 else None,
                    messages=["slow wire"],
                )
            )
    out = buf.getvalue()
    for needle in (
        "demo-run",
        "step 5/100",
        "producer",
        "12.3k",
        "cuda:1",
        "compiling",
        "41.5s",
        "3.25",
        "tau (real)",
        "2.50",
        "slow wire",
    ):
        assert needle in out, needle
    assert "█" in out or "▁" in out  # loss sparkline


def test_sparkline_shape():
    assert sparkline([1.0, 2.0, 3.0, 4.0]) == "▁▃▆█"
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert sparkline([2.0, 2.0]) == "▅▅"
    assert sparkline([1.0, float("nan"), 0.0]) == "█!▁"
    assert len(sparkline(list(range(100)), width=30)) == 30
    assert sparkline([]) == ""


def test_run_state_validates_progress():
    with pytest.raises(ValueError, match="progress"):
        RunState(progress=1.5)


def _render(table) -> str:
    buf = io.StringIO()
    Console(file=buf, width=160).print(table)
    return buf.getvalue()


def test_summary_table_start_middle_end():
    rows = [
        {
            "step": s,
            "time": 1000.0 + 10 * s,
            "loss": 5.0 - 0.5 * s,
            "acc": [0.1 * s, 0.05 * s],
            "tokens_per_s": 1000.0 * s,
        }
        for s in range(1, 6)
    ]
    rows.append({"step": 5, "time": 1060.0, "simulated/tau": 3.5, "real/tau": 2.25, "real/tau_pooled": 2.0})
    rows.insert(2, {"step": 2, "time": 1020.0, "simulated/tau": 1.75})
    table = summary_table(rows)
    text = _render(table)
    assert [c.header for c in table.columns] == ["metric", "start", "middle", "end"]
    labels = list(table.columns[0].cells)
    assert labels == [
        "loss",
        "acc (mean of slots)",
        "tau (simulated)",
        "tau (real)",
        "tau (real, pooled over steps)",
        "tokens/s",
        "steps",
        "wall time",
    ]
    start, middle, end = (list(table.columns[i].cells) for i in (1, 2, 3))
    assert (start[0], middle[0], end[0]) == ("4.5000 @1", "3.5000 @3", "2.5000 @5")  # loss goes down
    assert (start[1], end[1]) == ("0.075 @1", "0.375 @5")
    assert (start[2], end[2]) == ("1.75 @2", "3.50 @5")
    assert (start[3], end[3]) == ("2.25 @5", "2.25 @5")  # one real evaluation, at the end
    assert end[4] == "2.00 @5"
    assert (start[5], end[5]) == ("1.0k @1", "5.0k @5")
    assert (start[6], middle[6], end[6]) == ("1", "3", "5")
    assert end[7] == "0:50"  # 1060 - 1010
    assert "run summary" in text


def test_summary_table_resumed_run_and_empty():
    rows = [
        {"step": 1, "time": 0.0, "loss": 3.0},
        {"step": 2, "time": 1.0, "loss": 2.9},
        {"step": 2, "time": 5.0, "loss": 2.5},  # resumed from step 1: later record wins
    ]
    table = summary_table(rows)
    assert list(table.columns[3].cells)[0] == "2.5000 @2"
    empty = summary_table([])
    assert "no metrics" in _render(empty)
