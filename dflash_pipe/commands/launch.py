"""``dflash-pipe launch``: every run option (made from the config fields), the config file, the dry run and
the run itself; its errors become one line and an exit code a script can branch on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from dflash_pipe.commands import check_machine, console
from dflash_pipe.commands.options import field_options
from dflash_pipe.commands.split import picked_split, probe_gpus


@click.command()
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
    from dflash_pipe.commands.launch_config import build_run_config, config_text, load_run_file, plan_text

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

    from dflash_pipe.compute.torch_threads import exit_past_computing
    from dflash_pipe.data import DataError
    from dflash_pipe.diskspace import DiskFullError
    from dflash_pipe.launcher import checkpoint_note
    from dflash_pipe.launcher import launch as run
    from dflash_pipe.producer.errors import NothingToTrain, RunAborted
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
    exit_past_computing(lambda line: console.print(line, markup=False, highlight=False))
