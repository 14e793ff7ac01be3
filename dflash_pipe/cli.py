"""The ``dflash-pipe`` command line: builds the run config from flags and calls one library function.

torch is imported lazily inside each command, so ``worker`` can point the compile cache at the run's
directory before torch (and Inductor) read their environment.

Why it is past 400 lines: it still holds option declarations that restate ``RunConfig`` and the bodies of
the eval and regenerate commands; making the CLI from the config and moving those bodies into the library
is issue 21 (the layering redesign, scheduled after the target/drafter/regeneration work it would move).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console

from dflash_pipe import __version__
from dflash_pipe.drafter.presets import PRESETS, presets_help

_STARTED = time.time()
console = Console(stderr=True, soft_wrap=True)


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

    \b
    Every command takes --config FILE (YAML, TOML or JSON). Shell completion (bash; zsh/fish alike):
      eval "$(_DFLASH_PIPE_COMPLETE=bash_source dflash-pipe)"
    """


TARGET_MODEL = click.option(
    "--target-model",
    type=click.Path(path_type=Path),
    help="HF model directory of the target (default: the built-in demo target).",
)
DEVICE = click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="auto: CUDA if a GPU is visible, else CPU.",
)


def regen_flags(*, launch: bool) -> Callable:
    """The regeneration flags, shared by ``launch`` (where they fill ``data.*`` / ``regen.*``) and
    ``regenerate``; unset ones leave the config's value (``regenerate``: RegenConfig's defaults)."""
    options = [
        click.option(
            "--chat-template-arg",
            multiple=True,
            metavar="KEY=VALUE",
            help="Extra apply_chat_template argument for rendering and generation prompts, e.g. "
            "enable_thinking=false (VALUE read as JSON, else a string); repeatable.",
        ),
        click.option("--temperature", type=float, help="Regeneration: 0 greedy (default), > 0 sampled."),
        click.option(
            "--top-p", type=float, help="Regeneration: nucleus sampling threshold in (0, 1] (default 1)."
        ),
        click.option(
            "--top-k", type=int, help="Regeneration: sample among the k most likely tokens (0: all)."
        ),
        click.option(
            "--regen-seed", type=int, help="Regeneration: sampling seed (per conversation and turn)."
        ),
        click.option(
            "--max-new-tokens",
            type=int,
            help="Regeneration: tokens per assistant turn at most (default 1024).",
        ),
        click.option(
            "--regen-batch", type=int, help="Regeneration: conversations decoded together (default 32)."
        ),
    ]
    if launch:
        options.insert(
            0,
            click.option(
                "--responses",
                type=click.Choice(["dataset", "target"]),
                help="Train on the data's assistant turns, or on the target's own replies: it regenerates "
                "every turn first, turn by turn, while the drafters already train (default dataset; demo target).",
            ),
        )

    def apply(fn: Callable) -> Callable:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


@main.command()
@TARGET_MODEL
@click.option(
    "--data",
    "data_path",
    type=click.Path(path_type=Path),
    help="JSONL training data: messages, ShareGPT or input_ids+loss_mask (default with the demo: bundled samples).",
)
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    help="Where config, metrics, logs and checkpoints go (default: runs/<time>).",
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(path_type=Path),
    help="Continue the run in this directory (wherever it was started) from its latest intact checkpoint, "
    "with its saved config; a finished run says how to train on (--epochs, --max-steps).",
)
@DEVICE
@click.option("--target-gpus", help="GPUs of the target replicas, e.g. 0-4 or 0,1.")
@click.option("--drafter-gpus", help="GPUs of the drafter workers (one process each), e.g. 5-7.")
@click.option(
    "--target-parallel",
    type=click.Choice(["auto", "replicas", "split"]),
    help="One target replica per GPU, or one replica split by layers across the target GPUs "
    "(auto: replicas when the weights fit one GPU).",
)
@click.option("--workers", type=int, default=2, show_default=True, help="Number of drafter workers on CPU.")
@click.option(
    "--drafter-mode",
    type=click.Choice(["processes", "threads"]),
    help="One worker process per drafter device (default), or one process with a drafter thread per device.",
)
@click.option("--epochs", type=int, help="Epochs over the data (recipe: 6; demo: 1).")
@click.option("--max-steps", type=int, help="Stop after this many optimizer steps.")
@click.option("--lr", type=float, help="Peak learning rate (recipe: 6e-4).")
@click.option(
    "--token-budget",
    type=int,
    help="Max tokens per batch (default 4096: one 3072-token sample with 512 anchors, or several short ones; demo 2048).",
)
@click.option("--max-length", type=int, help="Longer samples are truncated (default 3072; demo 512).")
@click.option(
    "--skip-bad-lines", is_flag=True, help="Skip and count malformed data lines instead of stopping."
)
@click.option(
    "--tokenize-workers",
    type=int,
    help="Processes tokenizing --data in parallel, while the target loads (default: one per core but one; "
    "0 or 1: in-process; files under 4 MiB always in-process).",
)
@click.option(
    "--drafter-preset",
    type=click.Choice(list(PRESETS)),
    help="A served drafter's shape (widths follow the target; the flags below override its fields): "
    + presets_help()
    + ".",
)
@regen_flags(launch=True)
@click.option("--draft-layers", type=int, help="Drafter depth (default 5).")
@click.option(
    "--layer-types",
    help="Attention of each draft layer, comma-separated: full_attention or sliding_attention (full/sliding "
    "for short), e.g. sliding,sliding,sliding,sliding,full (default: all full).",
)
@click.option(
    "--sliding-window",
    type=int,
    help="Keys a sliding_attention layer sees, the query included (e.g. 2048); needs sliding layers.",
)
@click.option("--block-size", type=int, help="Draft block size (default 16).")
@click.option("--mask-token-id", type=int, help="Mask token (default: a reserved token of the tokenizer).")
@click.option("--max-anchors", type=int, help="Sampled blocks per sequence (recipe: 512; demo: 32).")
@click.option(
    "--target-layer-ids", help="Comma-separated target layers to read (default: the even-spread rule)."
)
@click.option(
    "--attention",
    "attention_backend",
    type=click.Choice(["auto", "flex", "sdpa"]),
    help="Drafter attention backend (auto: flex on CUDA, SDPA on CPU).",
)
@click.option(
    "--compile",
    "compile_mode",
    type=click.Choice(["auto", "on", "off", "full"]),
    help="torch.compile the drafter's flex attention (auto: on CUDA); full: also its layers and CE terms "
    "(faster; see docs/performance.md before using it).",
)
@click.option(
    "--compile-warmup",
    type=click.Choice(["once", "each"]),
    help="Workers starting together on an empty compile cache: each = all compile at once (default; "
    "the shortest time to the first step); once = one compiles, the others wait and start warm (least CPU).",
)
@click.option(
    "--activation-checkpointing",
    type=click.Choice(["none", "layers", "loss", "all"]),
    help="Recompute in backward: the draft layers, the LM-head loss, or both (default none).",
)
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints (default 500).")
@click.option("--eval-every", type=int, help="Steps between tau evaluations (default: only at the end).")
@click.option("--eval-samples", type=int, help="Held-out samples for tau (default 16).")
@click.option(
    "--eval-generate",
    type=click.Choice(["off", "end", "every"]),
    help="Real tau by speculative decoding of held-out prompts: in the final evaluation (end, default), "
    "at every evaluation, or off (the simulated tau only).",
)
@click.option("--eval-prompts", type=int, help="Held-out prompts the real tau decodes (default 16).")
@click.option(
    "--eval-max-new-tokens", type=int, help="Tokens per real-tau answer at most (default 256; demo 128)."
)
@click.option("--seed", type=int, help="Seed of data order and anchor sampling.")
@click.option("--bind", help="Producer address (default tcp://127.0.0.1:0, a free loopback port).")
@click.option(
    "--keys",
    type=click.Path(path_type=Path),
    help="CURVE key directory (`dflash-pipe keys generate DIR`); needed when --bind is not loopback.",
)
@click.option(
    "--peer-timeout",
    type=float,
    help="Seconds of silence after which a worker or the producer is declared dead (default 120).",
)
@click.option(
    "--reconnect-timeout",
    type=float,
    help="Seconds the launched workers keep retrying a lost producer, waiting for --resume (default 300).",
)
@click.option(
    "--wire-dtype",
    type=click.Choice(["bf16", "fp8"]),
    help="Features on the wire: bf16 (the target's dtype) or fp8 (e4m3 + a scale per token and layer).",
)
@click.option(
    "--payload-path",
    type=click.Choice(["auto", "socket", "shm", "cuda_ipc"]),
    help="auto: GPU memory (CUDA IPC) or shared memory for same-host workers, frames for the rest "
    "(default); socket; shm only; cuda_ipc only.",
)
@click.option(
    "--log",
    multiple=True,
    metavar="SINK",
    help="Metrics sinks besides metrics.jsonl: tensorboard, wandb; repeat or comma-separate for several.",
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
    try:
        file_values = load_run_file(opts["config_file"]) if opts["config_file"] else None
        cfg, resume = build_run_config(typed, file_values)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    if opts["print_config"]:
        click.echo(config_text(cfg), nl=False)
        return
    if opts["dry_run"]:
        click.echo(plan_text(cfg, resume=resume))
        return
    _check_machine(cfg)
    _run_launch(cfg, resume=resume, live=opts["live"])


def _check_machine(cfg) -> None:
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


def _run_launch(cfg, *, resume: bool, live: bool | None) -> None:
    from dflash_pipe.data import DataError
    from dflash_pipe.launcher import launch as run
    from dflash_pipe.producer.proc import RunAborted
    from dflash_pipe.producer.setup import SetupError
    from dflash_pipe.report import print_summary
    from dflash_pipe.rundir import RunComplete
    from dflash_pipe.target.families import UnsupportedTargetError

    try:
        summary = run(cfg, resume=resume, console=console, live=live)
    except RunComplete as exc:  # nothing to train: say so (and how to train on), exit 0
        console.print(str(exc), markup=False, highlight=False)
        return
    except (DataError, SetupError, FileNotFoundError, UnsupportedTargetError) as exc:
        console.print(f"[red]error:[/] {exc}")
        sys.exit(2)
    except RunAborted as exc:
        console.print(f"[red]run stopped:[/] {exc}")
        console.print(f"Resume with: dflash-pipe launch --resume {cfg.run_dir}")
        sys.exit(1)
    print_summary(cfg.run_dir, summary, console)


@main.command()
@TARGET_MODEL
@click.option(
    "--data",
    "data_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL conversations (messages or ShareGPT) whose assistant turns the target answers anew.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output JSONL (messages format, provenance header); an existing one made the same way is resumed.",
)
@DEVICE
@click.option("--gpu", type=int, default=0, show_default=True, help="The GPU to generate on (with CUDA).")
@click.option(
    "--max-length",
    type=int,
    default=3072,
    show_default=True,
    help="Training length the file is for: a turn is generated only while the conversation fits under it.",
)
@click.option(
    "--skip-bad-lines", is_flag=True, help="Skip and count malformed data lines instead of stopping."
)
@regen_flags(launch=False)
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
    from dflash_pipe.data import DataConfig, DataError
    from dflash_pipe.data.config import RegenConfig
    from dflash_pipe.launch_options import parse_template_args
    from dflash_pipe.regenerate import regenerate_file

    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "regen_seed": "seed"}
    names |= {"max_new_tokens": "max_new_tokens", "regen_batch": "batch_size"}
    try:
        settings = RegenConfig(
            **{field: opts[flag] for flag, field in names.items() if opts[flag] is not None}
        )
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
    except KeyboardInterrupt:
        console.print(f"interrupted: what is in {opts['out']} stays; run the same command to go on")
        sys.exit(130)
    for line in summary.lines():
        console.print(line, markup=False, highlight=False)


@main.command()
@click.option(
    "--connect", required=True, help="The producer's address, as `launch` printed it (tcp://HOST:PORT)."
)
@click.option("--device", help="Device of this worker: cpu or cuda:N; comma-separated for several.")
@click.option("--gpus", help="Start one worker per GPU, e.g. 6 or 6,7.")
@click.option(
    "--threads",
    is_flag=True,
    help="One process for all the devices, a drafter thread each (launch --drafter-mode threads).",
)
@click.option("--name", help="Worker name in logs and the dashboard (default: HOST-DEVICE).")
@click.option(
    "--compile-cache", type=click.Path(path_type=Path), help="torch.compile cache dir to share with the run."
)
@click.option(
    "--join-timeout",
    type=float,
    default=900.0,
    show_default=True,
    help="Seconds to wait for the producer's WELCOME.",
)
@click.option(
    "--keys",
    type=click.Path(path_type=Path),
    help="The producer's CURVE key directory (needs client.key_secret and server.key).",
)
@click.option(
    "--reconnect-timeout",
    type=float,
    default=300.0,
    show_default=True,
    help="If the producer dies, seconds to keep trying the same address (for `launch --resume`); 0 exits.",
)
def worker(
    connect: str,
    device: str | None,
    gpus: str | None,
    threads: bool,
    name: str | None,
    compile_cache: Path | None,
    join_timeout: float,
    keys: Path | None,
    reconnect_timeout: float,
) -> None:
    """Run drafter worker(s) that connect to a producer.

    \b
    Examples:
      dflash-pipe worker --connect tcp://10.0.0.5:5555 --gpus 6,7
      dflash-pipe worker --connect tcp://127.0.0.1:5555 --device cpu
      dflash-pipe worker --connect tcp://10.0.0.5:5555 --gpus 6,7 --threads   # one process, two threads
    """
    import socket
    import subprocess

    from dflash_pipe.launcher import SAFE_GPU_ENV, compile_cache_env
    from dflash_pipe.layout import parse_gpu_spec

    if bool(device) == bool(gpus):
        raise click.UsageError("Give exactly one of --device (cpu, cuda:N) or --gpus (e.g. 6,7).")
    devices = device.split(",") if device else [f"cuda:{i}" for i in parse_gpu_spec(gpus, flag="--gpus")]
    if compile_cache is not None:
        os.environ.update(compile_cache_env(compile_cache, workers_on_host=len(devices)))
    for key, value in SAFE_GPU_ENV.items():
        os.environ.setdefault(key, value)
    host = socket.gethostname()
    if len(devices) > 1 and not threads:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dflash_pipe",
                    "worker",
                    "--connect",
                    connect,
                    "--device",
                    d,
                    "--name",
                    f"{name or host}-{d}",
                    "--join-timeout",
                    str(join_timeout),
                    "--reconnect-timeout",
                    str(reconnect_timeout),
                ]
                + (["--compile-cache", str(compile_cache)] if compile_cache else [])
                + (["--keys", str(keys)] if keys else [])
            )
            for d in devices
        ]
        sys.exit(max(p.wait() for p in procs))
    from dflash_pipe.train.worker import run_worker

    sys.exit(
        run_worker(
            connect,
            device=",".join(devices),
            name=name or f"{host}-{'+'.join(devices)}",
            join_timeout_s=join_timeout,
            started_at=_STARTED,
            keys=keys,
            reconnect_timeout_s=reconnect_timeout,
        )
    )


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
    Writes OUT_DIR/config.json (with dflash_config) and OUT_DIR/model.safetensors, which the
    reference DFlashDraftModel loads next to the target. The checkpoint is verified against its manifest
    first; a running run can be exported. Examples:
      dflash-pipe export runs/q8b out/qwen3-8b-dflash
      dflash-pipe export runs/q8b/checkpoints/step-00001000 out/q8b-step1000
    """
    from dflash_pipe.drafter import export_checkpoint
    from dflash_pipe.rundir import find_checkpoint

    try:
        checkpoint = find_checkpoint(checkpoint)
        export_checkpoint(checkpoint, out_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    console.print(f"exported {checkpoint} -> {out_dir}")


@main.command("eval")
@click.option(
    "--target-model",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="HF model directory of the target.",
)
@click.option(
    "--drafter",
    "drafter_dir",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="Exported drafter directory (see `export`).",
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="JSONL samples to evaluate on.",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda:N.")
@click.option(
    "--mode",
    type=click.Choice(["generate", "simulated"]),
    default="generate",
    show_default=True,
    help="generate: real speculative decoding of the samples' prompts, checked lossless against greedy "
    "decoding; simulated: the fast teacher-forced tau on the samples' own text.",
)
@click.option(
    "--max-samples",
    type=int,
    help="Evaluate at most this many samples (default: 16 prompts for generate, 256 samples for simulated).",
)
@click.option(
    "--max-new-tokens",
    type=int,
    default=256,
    show_default=True,
    help="generate: each answer stops at its end-of-turn token or after this many tokens.",
)
@click.option(
    "--check/--no-check",
    default=True,
    show_default=True,
    help="generate: also decode each prompt greedily with the target and fail unless the outputs are equal "
    "(about doubles the time; gives the greedy tokens/s for the speedup).",
)
@click.option(
    "--num-anchors", type=int, default=64, show_default=True, help="simulated: blocks per sequence."
)
@click.option("--max-length", type=int, default=3072, show_default=True, help="Longer samples are truncated.")
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the result (metrics, command, versions) to this JSON file.",
)
def eval_cmd(
    target_model: Path,
    drafter_dir: Path,
    data_path: Path,
    device: str,
    mode: str,
    max_samples: int | None,
    max_new_tokens: int,
    check: bool,
    num_anchors: int,
    max_length: int,
    out_file: Path | None,
) -> None:
    """Acceptance length (tau) of a drafter against its target: real, or simulated.

    generate (default): real greedy speculative decoding as it is served. For each sample's prompt (its turns
    before the first assistant turn) the target prefills, the drafter drafts a block from the target's
    features, the target verifies it in one forward on its KV cache, the matching prefix plus the target's
    own token is kept; to the end of the turn. tau = tokens per draft-verify step (the bonus included), per
    draft position the share of steps that kept it, tokens/s; the output must equal the target's greedy
    decoding (exit status 1 if not). simulated: teacher-forced on the samples' own text at sampled anchors
    (fast; overstates tau when the data is not what the target says).

    \b
    Examples:
      dflash-pipe eval --target-model /models/Qwen3-8B --drafter out/qwen3-8b-dflash --data eval.jsonl
      dflash-pipe eval ... --mode simulated --max-samples 256
    """
    import json

    import torch
    from transformers import AutoTokenizer

    from dflash_pipe.data import DataConfig, load_samples
    from dflash_pipe.drafter.speculate import CacheCropError, LosslessError

    for name, value in (("--max-samples", max_samples), ("--max-new-tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise click.UsageError(f"{name} must be >= 1, got {value}.")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    limit = max_samples or (16 if mode == "generate" else 256)
    try:  # a drafter that does not fit the target, or bad data: one line naming the input, no traceback
        tokenizer = AutoTokenizer.from_pretrained(str(target_model))
        data = load_samples(DataConfig(path=data_path, max_length=max_length), tokenizer)
        if mode == "generate":
            from dflash_pipe.drafter.generate_eval import evaluate_export, render_generate_table

            result = evaluate_export(
                target_model,
                drafter_dir,
                data.samples,
                tokenizer=tokenizer,
                device=dev,
                max_prompts=limit,
                max_new_tokens=max_new_tokens,
                check=check,
                progress=console.is_terminal,
            )
            Console().print(render_generate_table(result))
            metrics = result.metrics()
        else:
            from dflash_pipe.drafter.evaluate import render_acceptance_table, simulate_export

            simulated = simulate_export(
                target_model,
                drafter_dir,
                data.samples[:limit],
                device=dev,
                num_anchors=num_anchors,
                progress=console.is_terminal,
            )
            Console().print(render_acceptance_table(simulated))
            metrics = simulated.metrics()
    except (ValueError, OSError) as exc:  # DataError is a ValueError
        raise click.ClickException(str(exc)) from None
    except (LosslessError, CacheCropError) as exc:  # the one number would be wrong: say so and fail
        raise click.ClickException(str(exc)) from None
    if out_file is not None:
        from dflash_pipe.bench.save import provenance

        record = {
            "mode": mode,
            "command": sys.argv,
            "target_model": str(target_model),
            "drafter": str(drafter_dir),
            "data": str(data_path),
            "metrics": metrics,
            "provenance": provenance(),
        }
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(record, indent=2) + "\n")
        console.print(f"wrote {out_file}")
    if mode == "generate":  # every prompt ran and the record is written: now fail loudly on a mismatch
        try:
            result.check_lossless()
        except LosslessError as exc:
            raise click.ClickException(str(exc)) from None


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


@main.group()
def bench() -> None:
    """Measure this machine: pipeline stages, transports, compile start-up; each beside its baseline.

    \b
    Every bench shows a table, checks its goal, and writes OUT/<name>.json (machine, versions, config,
    figures) and OUT/<name>.png. CPU defaults finish in about a minute each.
      dflash-pipe bench throughput                  # demo target on CPU, every stage and the pipeline
      dflash-pipe bench throughput --compare        # plus offline (disk) and threaded designs
      dflash-pipe bench transport                   # GB/s of each transport vs memcpy
      dflash-pipe bench compile                     # time to first step: cold, warm, N together
    """


def _bench_out(out: Path | None) -> Path:
    return out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")


def _bench_scratch(out: Path, keep: bool):
    """Where a bench's scratch files go (run dirs, batch files, compile caches): OUT/work with
    --keep-work, else a temporary directory removed at the end."""
    import contextlib
    import tempfile

    if keep:
        return contextlib.nullcontext(out / "work")
    return tempfile.TemporaryDirectory(prefix="dflash-bench-")


def _finish_bench(result, out: Path) -> None:
    from dflash_pipe.bench.save import save_result, show_result

    show_result(result, Console())
    for kind, path in save_result(result, out).items():
        console.print(f"wrote {kind.upper()} {path}")


def _bench_progress():
    """A rich status line that shows the stage being measured (plain lines when not on a terminal)."""
    from contextlib import contextmanager

    @contextmanager
    def progress():
        if not console.is_terminal:
            yield lambda text: console.print(f"bench: {text}")
            return
        with console.status("bench: starting") as status:
            yield lambda text: status.update(f"bench: {text}")

    return progress()


_KEEP_OPTION = click.option(
    "--keep-work", is_flag=True, help="Keep the scratch files (run dirs, logs, caches) in OUT/work."
)
_OUT_OPTION = click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Results directory for the JSON and PNG (default: bench-results/<time>).",
)


@bench.command("throughput")
@click.option(
    "--target-model", type=click.Path(path_type=Path), help="HF model directory (default: the demo target)."
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(path_type=Path),
    help="JSONL data (default with the demo: bundled).",
)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--target-gpus", help="GPUs of the target replicas, e.g. 0-4.")
@click.option("--drafter-gpus", help="GPUs of the drafter workers, e.g. 5-7.")
@click.option("--workers", type=int, help="Drafter workers on CPU (default 2).")
@click.option("--token-budget", type=int, help="Max tokens per batch (as `launch`).")
@click.option("--max-length", type=int, help="Longer samples are truncated (as `launch`).")
@click.option("--draft-layers", type=int, help="Drafter depth (as `launch`).")
@click.option("--max-anchors", type=int, help="Sampled blocks per sequence (as `launch`).")
@click.option(
    "--compile", "compile_mode", type=click.Choice(["auto", "on", "off", "full"]), help="As `launch`."
)
@click.option("--seconds", type=float, default=3.0, show_default=True, help="Measured seconds per stage.")
@click.option("--compare", is_flag=True, help="Also run offline (features via disk) and threaded drafters.")
@_OUT_OPTION
@_KEEP_OPTION
def bench_throughput(seconds: float, compare: bool, out_dir: Path | None, keep_work: bool, **opts) -> None:
    """Tokens/s of the producer, the drafters and the transport alone and of the whole pipeline.

    \b
    All on the same data; pipeline efficiency = pipeline / slowest stage alone (goal >= 0.95; when the
    target and the drafters share devices, the goal is checked against the time-sharing bound
    1 / (1/producer alone + 1/drafters alone)), and where time goes (target idle waiting for credits,
    workers waiting for batches, queue depth). Examples:
      dflash-pipe bench throughput --seconds 3
      dflash-pipe bench throughput --target-model /models/Qwen3-8B --data chat.jsonl \\
          --target-gpus 0 --drafter-gpus 0 --seconds 20 --compare --out bench-results/h200
    """
    from dflash_pipe.bench.throughput import run_throughput_bench
    from dflash_pipe.launch_options import build_run_config

    if seconds <= 0:
        raise click.UsageError(f"--seconds must be > 0, got {seconds}.")
    out = _bench_out(out_dir)
    try:
        cfg, _ = build_run_config({**opts, "run_dir": out / "work" / "prepare"})
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    _check_machine(cfg)
    with _bench_scratch(out, keep_work) as scratch, _bench_progress() as progress:
        try:
            result = run_throughput_bench(
                cfg, seconds=seconds, work_dir=Path(scratch), compare=compare, progress=progress
            )
        except (RuntimeError, ValueError, FileNotFoundError) as exc:  # a stage failed: its log's end
            hint = "" if keep_work else " (rerun with --keep-work to keep the logs)"
            raise click.ClickException(f"bench throughput failed{hint}: {exc}") from None
    _finish_bench(result, out)


@bench.command("transport")
@click.option("--sizes-mib", help="Comma-separated message sizes in MiB (default: the bench's own list).")
@click.option(
    "--budget-mib",
    type=int,
    default=384,
    show_default=True,
    help="MiB moved per path and size (>= 3 messages).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="cuda adds the GPU cases (device -> pinned host, GPU -> worker GPU through shm and through CUDA "
    "IPC); auto: when a GPU is present.",
)
@_OUT_OPTION
def bench_transport(sizes_mib: str | None, budget_mib: int, device: str, out_dir: Path | None) -> None:
    """GB/s of every transport (tcp, ipc, same-host paths) by message size, against a memcpy of the same bytes.

    \b
    Goals: the wire adds <= 5% over raw pyzmq at the same sizes and frames; the same-host ring moves GPU ->
    worker GPU at >= 25 GB/s. With CUDA the summary also says which same-host GPU path (shm or cuda_ipc)
    is faster. Example:
      dflash-pipe bench transport --sizes-mib 1,16,126 --budget-mib 2048
    """
    from dflash_pipe.bench.transport import run_transport_bench

    try:
        sizes = [float(x) for x in sizes_mib.split(",")] if sizes_mib else [1.0, 16.0, 126.0]
    except ValueError:
        raise click.UsageError(
            f"--sizes-mib {sizes_mib!r}: give numbers separated by commas, e.g. 1,4,16"
        ) from None
    out = _bench_out(out_dir)
    with _bench_progress() as progress:
        progress("transport")
        cuda = None if device == "auto" else device == "cuda"
        result = run_transport_bench(sizes, budget_mib=budget_mib, cuda=cuda)
    _finish_bench(result, out)


@bench.command("compile")
@click.option(
    "--target-model", type=click.Path(path_type=Path), help="HF model directory (default: the demo target)."
)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--drafter-gpus", help="GPUs of the N workers started together, e.g. 0 or 0-3 (default: 0).")
@click.option("--workers", type=int, default=2, show_default=True, help="N: workers started together.")
@click.option("--draft-layers", type=int, help="Drafter depth (default: 1 on CPU, 5 on CUDA).")
@click.option(
    "--seq-len", type=int, help="Tokens of the warm-up and the first step (default: 256 CPU, 2048 CUDA)."
)
@click.option(
    "--compile-warmup",
    "warmups",
    default="each",
    show_default=True,
    help="How the N together warm up (launch --compile-warmup): once, each, or once,each to compare both.",
)
@_OUT_OPTION
@_KEEP_OPTION
def bench_compile(
    target_model: Path | None,
    device: str,
    drafter_gpus: str | None,
    workers: int,
    draft_layers: int | None,
    seq_len: int | None,
    warmups: str,
    out_dir: Path | None,
    keep_work: bool,
) -> None:
    """Time to first training step: cold cache, warm cache, and N workers started together on one cache.

    \b
    Workers start as the launcher starts them (shared cache, the warm-up lock). Goal: N together within
    1.2x of one worker's cold time. On CPU the drafter's layers are compiled for the bench (a CPU worker
    compiles nothing). Examples:
      dflash-pipe bench compile
      dflash-pipe bench compile --target-model /models/Qwen3-8B --drafter-gpus 0 --workers 3
    """
    from dflash_pipe.bench.compile import run_compile_bench
    from dflash_pipe.layout import parse_gpu_spec

    if workers < 1:
        raise click.UsageError(f"--workers must be >= 1, got {workers}.")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = parse_gpu_spec(drafter_gpus, flag="--drafter-gpus") if drafter_gpus else (0,)
    out = _bench_out(out_dir)
    with _bench_scratch(out, keep_work) as scratch, _bench_progress() as progress:
        try:
            result = run_compile_bench(
                target_model=target_model,
                device=device,
                gpus=gpus,
                workers=workers,
                draft_layers=draft_layers,
                seq_len=seq_len,
                warmups=tuple(w.strip() for w in warmups.split(",") if w.strip()),
                work_dir=Path(scratch),
                progress=progress,
            )
        except (ValueError, FileNotFoundError) as exc:
            raise click.UsageError(str(exc)) from None
        except RuntimeError as exc:  # a worker start failed: the end of its log
            hint = "" if keep_work else " (rerun with --keep-work to keep the logs)"
            raise click.ClickException(f"bench compile failed{hint}: {exc}") from None
    _finish_bench(result, out)


def _load_option_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    """Eager: the file's values become this command's defaults, so typed flags still win."""
    from dflash_pipe.config_file import ConfigFileError, load_file, option_defaults

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


_add_config_options(main)

if __name__ == "__main__":
    main()
