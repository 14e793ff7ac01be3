"""The dashboard's regeneration line, in plain and live mode."""

from __future__ import annotations

import io

from rich.console import Console

from dflash_pipe.telemetry import Dashboard, RunState
from dflash_pipe.telemetry.dashboard import regen_text

GOING = {"done": 120.0, "total": 3000.0, "tokens_per_s": 1234.0, "failed_turns": 2.0, "dropped": 0.0}


def test_regen_text_shows_progress_rate_and_failures():
    assert regen_text(GOING) == "regen 120/3000 conv 1.2k tok/s 2 failed"
    assert regen_text({**GOING, "done": 3000.0, "failed_turns": 0.0}) == "regen 3000/3000 conv"


def test_regen_text_shows_the_target_time_generating_and_the_drafters_idle():
    shares = {**GOING, "target_share": 0.64, "drafters_idle_share": 0.031}
    assert (
        regen_text(shares)
        == "regen 120/3000 conv 1.2k tok/s (target 64% generating, drafters 3% idle) 2 failed"
    )


def test_plain_and_live_modes_show_regeneration():
    dash = Dashboard("run", total_steps=None, live=False, console=Console(file=io.StringIO()))
    line = dash.plain_line(RunState(step=3, regen=GOING))
    assert "| regen 120/3000 conv 1.2k tok/s 2 failed |" in line
    assert "regen" not in dash.plain_line(RunState(step=3))  # dataset responses: no line
    buf = io.StringIO()
    with Dashboard("run", total_steps=10, console=Console(file=buf, force_terminal=True, width=140)) as live:
        live.update(RunState(step=1, regen=GOING))
    assert "regenerate" in buf.getvalue() and "120/3000 conv 1.2k tok/s" in buf.getvalue()
