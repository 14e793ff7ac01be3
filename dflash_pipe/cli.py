"""The ``dflash-pipe`` command line: the group and its commands, one module each in ``dflash_pipe.commands``.

Nothing here but assembly. torch is imported lazily inside each command, so ``worker`` can point the
compile cache at the run's directory before torch (and Inductor) read their environment.
"""

from __future__ import annotations

import click

from dflash_pipe import __version__
from dflash_pipe.commands.bench import bench
from dflash_pipe.commands.config_option import add_config_options
from dflash_pipe.commands.evaluate import eval_cmd
from dflash_pipe.commands.export import export, serve_command_cmd
from dflash_pipe.commands.keys import keys
from dflash_pipe.commands.launch import launch
from dflash_pipe.commands.producer import producer
from dflash_pipe.commands.regenerate import regenerate
from dflash_pipe.commands.report import report
from dflash_pipe.commands.worker import worker


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


for _command in (
    launch,
    regenerate,
    keys,
    export,
    serve_command_cmd,
    report,
    worker,
    producer,
    eval_cmd,
    bench,
):
    main.add_command(_command)
add_config_options(main)

if __name__ == "__main__":
    main()
