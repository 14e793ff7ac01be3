"""End-of-run summary: what the metrics say about the run, as a rich table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dflash_pipe.telemetry import read_metrics, summary_table


def print_summary(run_dir: Path, summary: Any, console: Console) -> None:
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    console.print(summary_table(rows, title=f"run summary: {run_dir}"))
    table = Table(title="workers", show_header=True)
    table.add_column("worker")
    table.add_column("time to first step", justify="right")
    for name, seconds in sorted(summary.first_step_s.items()):
        table.add_row(name, f"{seconds:.1f} s")
    console.print(table)
    tokens_s = summary.acked_tokens / summary.wall_s if summary.wall_s else 0.0
    console.print(
        f"{summary.steps} steps in {summary.wall_s:.0f} s ({tokens_s:,.0f} tokens/s overall, "
        f"{summary.steady_tokens_per_s:,.0f} tokens/s after the first step); "
        f"stopped: {summary.stop_reason}; last checkpoint: {summary.last_checkpoint}"
    )
