"""``dflash-pipe report``: a run's curves and summary, finished or running."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the PNGs go (default: RUN_DIR/report/).",
)
def report(run_dir: Path, out_dir: Path | None) -> None:
    """Curves (loss, accuracy, tau, throughput) as PNGs and a summary table of a run, finished or running.

    \b
    Reads RUN_DIR/metrics.jsonl (a line still being written is skipped). Examples:
      dflash-pipe report runs/q8b                      # PNGs in runs/q8b/report/
      dflash-pipe report runs/q8b --out /tmp/q8b-plots
    """
    from dflash_pipe.report import report as run_report

    try:
        run_report(run_dir, out_dir, Console())
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
