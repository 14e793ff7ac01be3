"""The ``dflash-pipe`` command line: builds the run config from flags and calls one library function.

torch is imported lazily inside each command, so ``worker`` can point the compile cache at the run's
directory before torch (and Inductor) read their environment.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console

from dflash_pipe import __version__

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
    """


@main.command()
@click.option(
    "--target-model",
    type=click.Path(path_type=Path),
    help="HF model directory of the target (default: the built-in demo target).",
)
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
    help="Continue the run in this directory from its latest checkpoint, with its saved config.",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="auto: CUDA if a GPU is visible, else CPU.",
)
@click.option("--target-gpus", help="GPUs of the target replicas, e.g. 0-4 or 0,1.")
@click.option("--drafter-gpus", help="GPUs of the drafter workers (one process each), e.g. 5-7.")
@click.option("--workers", type=int, default=2, show_default=True, help="Number of drafter workers on CPU.")
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
@click.option("--draft-layers", type=int, help="Drafter depth (default 5).")
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
    type=click.Choice(["auto", "on", "off"]),
    help="torch.compile the drafter's flex attention (auto: on CUDA).",
)
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints (default 500).")
@click.option("--eval-every", type=int, help="Steps between tau evaluations (default: only at the end).")
@click.option("--eval-samples", type=int, help="Held-out samples for tau (default 16).")
@click.option("--seed", type=int, help="Seed of data order and anchor sampling.")
@click.option("--bind", help="Producer address (default tcp://127.0.0.1:0, a free loopback port).")
@click.option(
    "--peer-timeout",
    type=float,
    help="Seconds of silence after which a worker or the producer is declared dead (default 120).",
)
@click.option(
    "--live/--plain", default=None, help="Live dashboard or plain log lines (default: live on a terminal)."
)
def launch(**opts) -> None:
    """Start a training run: the producer here, one drafter worker per drafter GPU.

    \b
    Examples:
      dflash-pipe launch                                   # built-in demo, a few minutes on 2 CPU cores
      dflash-pipe launch --target-model /models/Qwen3-8B --data chat.jsonl \\
          --target-gpus 0-4 --drafter-gpus 5-7 --run-dir runs/q8b
      dflash-pipe launch --target-gpus 0 --drafter-gpus 0 ...   # one GPU for both (warns)
      dflash-pipe launch --resume runs/q8b                 # continue after Ctrl-C or a crash
    Ctrl-C drains: workers finish their step, a checkpoint is written, everyone exits.
    """
    from dflash_pipe.launch_options import build_run_config

    try:
        cfg, resume = build_run_config(opts)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    _run_launch(cfg, resume=resume, live=opts["live"])


def _run_launch(cfg, *, resume: bool, live: bool | None) -> None:
    from dflash_pipe.data import DataError
    from dflash_pipe.launcher import launch as run
    from dflash_pipe.producer.proc import RunAborted
    from dflash_pipe.producer.setup import RunDirError
    from dflash_pipe.report import print_summary

    try:
        summary = run(cfg, resume=resume, console=console, live=live)
    except (DataError, RunDirError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/] {exc}")
        sys.exit(2)
    except RunAborted as exc:
        console.print(f"[red]run stopped:[/] {exc}")
        console.print(f"Resume with: dflash-pipe launch --resume {cfg.run_dir}")
        sys.exit(1)
    print_summary(cfg.run_dir, summary, console)


@main.command()
@click.option(
    "--connect", required=True, help="The producer's address, as `launch` printed it (tcp://HOST:PORT)."
)
@click.option("--device", help="Device of this worker: cpu or cuda:N.")
@click.option("--gpus", help="Start one worker per GPU, e.g. 6 or 6,7.")
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
def worker(
    connect: str,
    device: str | None,
    gpus: str | None,
    name: str | None,
    compile_cache: Path | None,
    join_timeout: float,
) -> None:
    """Run drafter worker(s) that connect to a producer.

    \b
    Examples:
      dflash-pipe worker --connect tcp://10.0.0.5:5555 --gpus 6,7
      dflash-pipe worker --connect tcp://127.0.0.1:5555 --device cpu
    """
    import socket
    import subprocess

    from dflash_pipe.launcher import SAFE_GPU_ENV, compile_cache_env
    from dflash_pipe.layout import parse_gpu_spec

    if bool(device) == bool(gpus):
        raise click.UsageError("Give exactly one of --device (cpu, cuda:N) or --gpus (e.g. 6,7).")
    devices = [device] if device else [f"cuda:{i}" for i in parse_gpu_spec(gpus, flag="--gpus")]
    if compile_cache is not None:
        os.environ.update(compile_cache_env(compile_cache, workers_on_host=len(devices)))
    for key, value in SAFE_GPU_ENV.items():
        os.environ.setdefault(key, value)
    host = socket.gethostname()
    if len(devices) > 1:
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
                ]
                + (["--compile-cache", str(compile_cache)] if compile_cache else [])
            )
            for d in devices
        ]
        sys.exit(max(p.wait() for p in procs))
    from dflash_pipe.train.worker import run_worker

    sys.exit(
        run_worker(
            connect,
            device=devices[0],
            name=name or f"{host}-{devices[0]}",
            join_timeout_s=join_timeout,
            started_at=_STARTED,
        )
    )


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
def export(checkpoint: Path, out_dir: Path) -> None:
    """Export a checkpoint (or a run dir's latest) to the DFlash reference format.

    \b
    Writes OUT_DIR/config.json (with dflash_config) and OUT_DIR/model.safetensors, which the
    reference DFlashDraftModel loads next to the target. Example:
      dflash-pipe export runs/q8b out/qwen3-8b-dflash
    """
    from dflash_pipe.drafter import export_checkpoint
    from dflash_pipe.train.checkpoint import latest_checkpoint

    if (checkpoint / "checkpoints").is_dir():
        latest = latest_checkpoint(checkpoint)
        if latest is None:
            raise click.UsageError(f"{checkpoint} is a run dir without checkpoints yet.")
        checkpoint = latest
    try:
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
    "--max-samples", type=int, default=256, show_default=True, help="Evaluate at most this many samples."
)
@click.option("--num-anchors", type=int, default=64, show_default=True, help="Sampled blocks per sequence.")
@click.option("--max-length", type=int, default=3072, show_default=True)
def eval_cmd(
    target_model: Path,
    drafter_dir: Path,
    data_path: Path,
    device: str,
    max_samples: int,
    num_anchors: int,
    max_length: int,
) -> None:
    """Simulated acceptance length (tau) of a drafter against its target.

    Greedy and teacher-forced: at sampled anchors, count how many consecutive draft tokens equal the
    target's own greedy predictions, plus one. Example:
      dflash-pipe eval --target-model /models/Qwen3-8B --drafter out/qwen3-8b-dflash --data eval.jsonl
    """
    import torch
    from transformers import AutoTokenizer

    from dflash_pipe.data import DataConfig, load_samples
    from dflash_pipe.drafter import (
        evaluate_acceptance,
        load_exported,
        load_frozen_target_parts,
        render_acceptance_table,
    )
    from dflash_pipe.drafter.export import config_from_export
    from dflash_pipe.target import TargetCore

    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    import json

    cfg = config_from_export(json.loads((drafter_dir / "config.json").read_text()))
    tokenizer = AutoTokenizer.from_pretrained(str(target_model))
    data = load_samples(DataConfig(path=data_path, max_length=max_length), tokenizer)
    target = TargetCore(target_model, cfg.target_layer_ids, dev, dtype)
    embed, head = load_frozen_target_parts(target_model, dtype=dtype, device=dev)
    drafter = load_exported(drafter_dir, embed_tokens=embed, lm_head=head).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        result = evaluate_acceptance(
            target, drafter, data.samples[:max_samples], num_anchors=num_anchors, progress=console.is_terminal
        )
    Console().print(render_acceptance_table(result))


if __name__ == "__main__":
    main()
