"""The commands of ``dflash-pipe``, one module each (``launch``, ``worker``, ``producer``, ``eval``,
``bench``, ...), assembled into the group by ``dflash_pipe.cli``; ``launch_config`` turns launch's flags and
config file into one RunConfig. torch is imported inside each command, never at import, so ``worker`` can
set the compile cache's environment before torch reads it."""

from __future__ import annotations

import time
from typing import Any

import click
from rich.console import Console

STARTED = time.time()
"""When the command line started (a launched worker's time to its first step counts from here)."""
console = Console(stderr=True, soft_wrap=True)
"""Where commands report: stderr, so stdout stays the command's output (``--print-config``)."""


def check_machine(cfg: Any) -> None:
    """What a dry run leaves out: GPU ids against this machine, metrics sinks installed."""
    from dflash_pipe.telemetry import sink_problem

    problems = [p for kind in cfg.log if (p := sink_problem(kind))]
    if problems:
        raise click.UsageError("; ".join(problems))
    if cfg.layout.device == "cuda":
        import torch

        try:
            cfg.layout.validate_against(torch.cuda.device_count())
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
