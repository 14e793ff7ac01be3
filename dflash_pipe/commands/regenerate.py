"""``dflash-pipe regenerate``: the target answers a file's assistant turns anew, outside a run."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import click
from rich.markup import escape

from dflash_pipe.commands import console
from dflash_pipe.commands.options import field_options
from dflash_pipe.data.config import RegenConfig


@click.command()
@field_options("target_model")
@click.option(
    "--data",
    "data_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Conversations (messages or ShareGPT) whose assistant turns the target answers anew: a JSONL file, "
    "parquet/arrow files, a save_to_disk folder or a cached Hub dataset id, as launch --data takes.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output JSONL (messages format, provenance header); an existing one made the same way is resumed.",
)
@field_options("layout.device")
@click.option("--gpu", type=int, default=0, show_default=True, help="The GPU to generate on (with CUDA).")
@click.option(
    "--max-length",
    type=int,
    default=3072,
    show_default=True,
    help="Training length the file is for: a turn is generated only while the conversation fits under it.",
)
@field_options(
    "data.skip_bad_lines", "data.chat_template_kwargs", *(f"regen.{f.name}" for f in fields(RegenConfig))
)
def regenerate(**opts) -> None:
    """Regenerate every assistant turn of --data with the target, turn by turn, into --out.

    \b
    The step `launch --responses target` runs inside the pipeline, alone: for people who want the file.
    Run the same command again after a kill or Ctrl-C: only what is not in --out yet is generated.
    Train on the result with: dflash-pipe launch --data OUT --responses dataset ...
    \b
    Example:
      dflash-pipe regenerate --target-model /models/Qwen3-8B --data chat.jsonl --out chat.qwen3-8b.jsonl
    """
    from dflash_pipe.commands.launch_config import parse_template_args
    from dflash_pipe.commands.options import section_values
    from dflash_pipe.data import DataConfig, DataError
    from dflash_pipe.diskspace import DiskFullError
    from dflash_pipe.regenerate import regenerate_file
    from dflash_pipe.target.gguf import TargetPathError, resolve_target

    try:
        settings = RegenConfig(**section_values(opts, "regen"))
        data = DataConfig(
            path=opts["data_path"],
            max_length=opts["max_length"],
            skip_bad_lines=opts["skip_bad_lines"],
            chat_template_kwargs=parse_template_args(opts["chat_template_arg"]),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    device = opts["device"]
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{opts['gpu']}"
    try:
        target = resolve_target(opts["target_model"])  # a GGUF file: its converted folder
    except TargetPathError as exc:
        console.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(2)
    if target is None:
        from dflash_pipe.target import build_demo_target

        target = build_demo_target(progress=True)
    try:
        summary = regenerate_file(Path(target), data, settings, opts["out"], device=device)
    except DataError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(2)
    except DiskFullError as exc:
        console.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        console.print(f"interrupted: what is in {opts['out']} stays; run the same command to go on")
        sys.exit(130)
    for line in summary.lines():
        console.print(line, markup=False, highlight=False)
    if summary.interrupted:
        sys.exit(130)
