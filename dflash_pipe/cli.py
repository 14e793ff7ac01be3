"""The ``dflash-pipe`` command line: builds the run config from flags and calls one library function.

``launch``'s options are made from the config fields (``commands.options.field_options``); ``worker``,
``eval`` and ``bench`` live in ``dflash_pipe.commands``. torch is imported lazily inside each command, so
``worker`` can point the compile cache at the run's directory before torch (and Inductor) read their
environment.
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console

from dflash_pipe import __version__
from dflash_pipe.commands import check_machine, console
from dflash_pipe.commands.bench import bench
from dflash_pipe.commands.evaluate import eval_cmd
from dflash_pipe.commands.options import field_options
from dflash_pipe.commands.producer import producer
from dflash_pipe.commands.split import picked_split, probe_gpus
from dflash_pipe.commands.worker import worker
from dflash_pipe.data.config import RegenConfig


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dflash-pipe")
def main() -> None:
    """Train DFlash speculative-decoding drafters online.

    A frozen target LLM runs in a producer process on its own GPUs and streams hidden states over ZeroMQ
    to drafter worker processes, which train one drafter together. Nothing is written to disk but
    checkpoints and metrics.

    \b
    Quick start (no model needed: a tiny built-in target and sample data, CPU is fine):
      dflash-pipe launch
    A real run on one 8-GPU node:
      dflash-pipe launch --target-model /models/Qwen3-8B --data chat.jsonl \\
          --target-gpus 0-4 --drafter-gpus 5-7 --run-dir runs/qwen3-8b
    From a recipe (flags override the file; see launch/):
      dflash-pipe launch --config launch/node-8gpu.yaml --dry-run
    Curves and summary of a run, finished or running:
      dflash-pipe report runs/qwen3-8b
    The command that serves its drafter (vLLM, SGLang or the reference), every setting from the export:
      dflash-pipe serve-command runs/qwen3-8b --engine vllm

    \b
    Every command takes --config FILE (YAML, TOML or JSON). Shell completion (bash; zsh/fish alike):
      eval "$(_DFLASH_PIPE_COMPLETE=bash_source dflash-pipe)"
    """


@main.command()
@field_options()  # every RunConfig field with a flag (docs/configuration.md lists them next to their fields)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(path_type=Path),
    help="Continue the run in this directory (wherever it was started) from its latest intact checkpoint, "
    "with its saved config; a finished run says how to train on (--epochs, --max-steps).",
)
@click.option(
    "--live/--plain", default=None, help="Live dashboard or plain log lines (default: live on a terminal)."
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Run config file (YAML, TOML or JSON; the shape of a run's config.json). Flags override it.",
)
@click.option("--print-config", is_flag=True, help="Print the resolved config (YAML) and exit.")
@click.option(
    "--gpus",
    help="All the GPUs of the run (e.g. 0-7) without --target-gpus/--drafter-gpus: a probe of the target and "
    "the drafter (a few seconds each, as `bench split`) picks the split and says why.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (config, devices, workers, run dir) and exit; loads nothing, needs no GPU.",
)
def launch(**opts) -> None:
    """Start a training run: the producer here, one drafter worker per drafter GPU.

    \b
    Examples:
      dflash-pipe launch                                   # built-in demo, a few minutes on 2 CPU cores
      dflash-pipe launch --target-model /models/Qwen3-8B --data chat.jsonl \\
          --target-gpus 0-4 --drafter-gpus 5-7 --run-dir runs/q8b
      dflash-pipe launch --target-gpus 0 --drafter-gpus 0 ...   # one GPU for both (warns)
      dflash-pipe launch --responses target ...            # train on the target's own replies
      dflash-pipe launch --resume runs/q8b                 # continue after Ctrl-C or a crash
      dflash-pipe launch --config launch/node-8gpu.yaml --max-steps 100   # a recipe; flags win
      dflash-pipe launch --config run.yaml --dry-run       # the plan, nothing started
      dflash-pipe launch --log tensorboard,wandb ...       # metrics.jsonl plus mirrors
    Ctrl-C drains: workers finish their step, a checkpoint is written, everyone exits.
    """
    from dflash_pipe.launch_options import build_run_config, config_text, load_run_file, plan_text

    ctx = click.get_current_context()
    typed = {
        k: v
        for k, v in opts.items()
        if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    }
    gpus = probe_gpus(typed)
    try:
        file_values = load_run_file(opts["config_file"]) if opts["config_file"] else None
        cfg, resume = build_run_config(typed, file_values)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    if gpus and resume:
        raise click.UsageError("--gpus with --resume: a resumed run keeps its saved split.")
    if gpus and opts["dry_run"]:
        console.print(
            f"note: --gpus {opts['gpus']}: a probe picks the split when the run starts (`dflash-pipe bench "
            f"split --gpus {opts['gpus']}` shows its pick now); the plan below shows a placeholder split",
            markup=False,
            highlight=False,
        )
    if opts["print_config"]:
        click.echo(config_text(cfg), nl=False)
        return
    if opts["dry_run"]:
        click.echo(plan_text(cfg, resume=resume))
        return
    check_machine(cfg)
    if gpus:
        cfg = picked_split(cfg, gpus)
    _run_launch(cfg, resume=resume, live=opts["live"])


def _run_launch(cfg, *, resume: bool, live: bool | None) -> None:
    from rich.markup import escape

    from dflash_pipe.data import DataError
    from dflash_pipe.diskspace import DiskFullError
    from dflash_pipe.launcher import checkpoint_note
    from dflash_pipe.launcher import launch as run
    from dflash_pipe.producer.core import NothingToTrain, RunAborted
    from dflash_pipe.producer.setup import SetupError
    from dflash_pipe.report import print_summary
    from dflash_pipe.run.dir import RunDir
    from dflash_pipe.run.files import RunDirError
    from dflash_pipe.run.resume import RunComplete
    from dflash_pipe.run.signals import StopNow
    from dflash_pipe.target.families import UnsupportedTargetError

    try:
        summary = run(cfg, resume=resume, console=console, live=live)
    except RunComplete as exc:  # nothing to train: say so (and how to train on), exit 0
        console.print(str(exc), markup=False, highlight=False)
        return
    except StopNow as exc:  # a signal during set-up: nothing trained in this launch, nothing to drain
        saved = RunDir(cfg.run_dir).has_run()
        again = f"dflash-pipe launch --resume {cfg.run_dir}" if saved else "the same command"
        console.print(
            f"stopped by {exc} while the run was starting: no step was trained in this launch; "
            f"{checkpoint_note(cfg.run_dir, None)}. Start it again with {again}.",
            markup=False,
            highlight=False,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the target may still be loading in a thread: nothing of it is worth waiting for
    except (DataError, SetupError, RunDirError, FileNotFoundError, UnsupportedTargetError) as exc:
        console.print(f"[red]error:[/] {exc}")
        sys.exit(2)
    except NothingToTrain as exc:  # a resume would find the same: no "Resume with"
        console.print(f"[red]run stopped:[/] {escape(str(exc))}")
        sys.exit(1)
    except (RunAborted, DiskFullError) as exc:
        console.print(f"[red]run stopped:[/] {escape(str(exc))}")
        console.print(f"Resume with: dflash-pipe launch --resume {cfg.run_dir}")
        sys.exit(1)
    print_summary(cfg.run_dir, summary, console)


@main.command()
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
    from dflash_pipe.commands.options import section_values
    from dflash_pipe.data import DataConfig, DataError
    from dflash_pipe.diskspace import DiskFullError
    from dflash_pipe.launch_options import parse_template_args
    from dflash_pipe.regenerate import regenerate_file

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
    target = opts["target_model"]
    if target is None:
        from dflash_pipe.target import build_demo_target

        target = build_demo_target(progress=True)
    try:
        summary = regenerate_file(Path(target), data, settings, opts["out"], device=device)
    except DataError as exc:
        console.print(f"[red]error:[/] {exc}")
        sys.exit(2)
    except DiskFullError as exc:
        console.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        console.print(f"interrupted: what is in {opts['out']} stays; run the same command to go on")
        sys.exit(130)
    for line in summary.lines():
        console.print(line, markup=False, highlight=False)


@main.group()
def keys() -> None:
    """CURVE keys that authenticate workers to a producer on a non-loopback address."""


@keys.command("generate")
@click.argument("directory", type=click.Path(path_type=Path))
def keys_generate(directory: Path) -> None:
    """Write a server and a client key pair into DIRECTORY (files 0600, directory 0700).

    \b
    Then: dflash-pipe launch --bind tcp://0.0.0.0:5555 --keys DIRECTORY ...
          dflash-pipe worker --connect tcp://HOST:5555 --keys DIRECTORY ...
    Worker hosts need DIRECTORY/client.key_secret and DIRECTORY/server.key; only the producer host needs
    DIRECTORY/server.key_secret. See docs/security.md.
    """
    from dflash_pipe.wire.auth import KeyFileError, generate_keys

    try:
        files = generate_keys(directory)
    except (KeyFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    for path in files:
        console.print(f"wrote {path}")


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
def export(checkpoint: Path, out_dir: Path) -> None:
    """Export a checkpoint (or the latest of a run dir or its checkpoints/) to the DFlash reference format.

    \b
    Writes OUT_DIR/config.json (with dflash_config and auto_map) and OUT_DIR/model.safetensors, which
    the reference DFlashDraftModel loads next to the target, OUT_DIR/modeling_dflash.py (so that
    AutoModel.from_pretrained(OUT_DIR, trust_remote_code=True) loads it and its spec_generate speculates)
    and OUT_DIR/manifest.json (their sizes and sha256, checked by eval and on loading). The checkpoint is
    verified against its manifest first; a running run can be exported; a checkpoint trained 0 steps is
    refused. Ends with the vLLM command that serves it (dflash-pipe serve-command for the others). Examples:
      dflash-pipe export runs/q8b out/qwen3-8b-dflash
      dflash-pipe export runs/q8b/checkpoints/step-00001000 out/q8b-step1000
    """
    from dflash_pipe.drafter import export_checkpoint
    from dflash_pipe.drafter.serve import plan_from_export, run_settings, serve_command
    from dflash_pipe.run.locate import held_checkpoint

    try:
        with held_checkpoint(checkpoint) as checkpoint:  # a running run prunes none of it meanwhile
            target, template_kwargs = run_settings(checkpoint)
            export_checkpoint(checkpoint, out_dir, chat_template_kwargs=template_kwargs)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    except OSError as exc:  # OUT_DIR not writable, a full disk: one line, no traceback
        raise click.ClickException(f"cannot write the export to {out_dir}: {exc}") from None
    console.print(f"exported {checkpoint} -> {out_dir}")
    plan = plan_from_export(out_dir, target=target)
    console.print(
        f"Serve it with vLLM (for SGLang or the reference: dflash-pipe serve-command {out_dir} --engine "
        "sglang|reference):",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    console.print(serve_command(plan, "vllm"), end="", markup=False, highlight=False, soft_wrap=True)


@main.command("serve-command")
@click.argument(
    "path", metavar="RUN_OR_EXPORT", type=click.Path(exists=True, file_okay=False, path_type=Path)
)
@click.option(
    "--engine",
    type=click.Choice(["vllm", "sglang", "reference"]),
    default="vllm",
    show_default=True,
    help="Which server (or the reference's Python loop) the command is for.",
)
@click.option(
    "--target",
    help="The target model path or Hub id to serve beside the drafter (default: a run's own target; an "
    "export does not record it).",
)
def serve_command_cmd(path: Path, engine: str, target: str | None) -> None:
    """Print the exact command that serves a drafter beside its target, every setting from the export.

    \b
    RUN_OR_EXPORT: a `dflash-pipe export` directory, or a run dir / checkpoint (its latest checkpoint; the
    export command to run first is printed too). From the export's config.json: the draft-token count
    (vLLM: block_size - 1, SGLang: block_size), vLLM's V2 model runner for a drafter mixing sliding and full
    layers, and the chat template arguments it was trained with. Examples:
      dflash-pipe serve-command out/q8b --target /models/Qwen3-8B
      dflash-pipe serve-command runs/q8b --engine sglang
      dflash-pipe serve-command out/q8b --engine reference --target Qwen/Qwen3-8B
    """
    from dflash_pipe.drafter.serve import plan_from_path, serve_command

    try:
        plan = plan_from_path(path, target=target)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(serve_command(plan, engine), nl=False)


@main.command()
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


def _load_option_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    """Eager: the file's values become this command's defaults, so typed flags still win."""
    from dflash_pipe.run.config_file import ConfigFileError, load_file, option_defaults

    if value is None:
        return
    try:
        defaults = option_defaults(load_file(value), ctx.command.params, source=str(value))
    except ConfigFileError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}


def _add_config_options(group: click.Group) -> None:
    """Every command takes --config; `launch` has its own (a run config), the others a flat option file."""
    for command in group.commands.values():
        if isinstance(command, click.Group):
            _add_config_options(command)
        elif not any(p.name == "config_file" for p in command.params):
            command.params.append(
                click.Option(
                    ["--config", "config_file"],
                    type=click.Path(exists=True, dir_okay=False, path_type=Path),
                    is_eager=True,
                    expose_value=False,
                    callback=_load_option_file,
                    help="YAML, TOML or JSON file of this command's options (keys: option names); "
                    "flags override it.",
                )
            )


for _command in (worker, producer, eval_cmd, bench):
    main.add_command(_command)
_add_config_options(main)

if __name__ == "__main__":
    main()
