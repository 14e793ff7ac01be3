"""``dflash-pipe bench``: measure this machine (pipeline stages, transports, compile start-up), each figure
beside its baseline, saved as JSON with provenance and a PNG."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.console import Console

from dflash_pipe.commands import check_machine, console
from dflash_pipe.commands.options import field_options


@click.group()
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


_run_options = field_options(
    "target_model",
    "data.path",
    "layout.device",
    "layout.target_gpus",
    "layout.drafter_gpus",
    "layout.cpu_workers",
    "data.token_budget",
    "data.max_length",
    "drafter.num_layers",
    "drafter.max_anchors",
    "train.compile",
    "data.responses",
    "regen.max_new_tokens",
    "regen.batch_size",
    overrides={
        "data.responses": {
            "default": "dataset",
            "show_default": True,
            "help": "target: as `launch --responses target` (throughput: the pipeline runs again regenerating "
            "every assistant turn, beside the run on the dataset's; split: the target's supply includes "
            "regeneration).",
        }
    },
)
"""The run a throughput or split bench measures: target, data, layout and drafter, the `launch` options
of those fields (a bench measures the dataset's responses unless told)."""


@bench.command("throughput")
@_run_options
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
    workers waiting for batches, queue depth). With --responses target, the pipeline once more regenerating
    the target's responses (goals: >= 0.5x the trained tokens/s, <= 1.2x the launch to first step). Examples:
      dflash-pipe bench throughput --seconds 3
      dflash-pipe bench throughput --responses target --max-new-tokens 32
      dflash-pipe bench throughput --target-model /models/Qwen3-8B --data chat.jsonl \\
          --target-gpus 0 --drafter-gpus 0 --seconds 20 --compare --out bench-results/h200
    """
    from dflash_pipe.bench.throughput import run_throughput_bench
    from dflash_pipe.commands.launch_config import build_run_config

    if seconds <= 0:
        raise click.UsageError(f"--seconds must be > 0, got {seconds}.")
    out = _bench_out(out_dir)
    try:
        cfg, _ = build_run_config({**opts, "run_dir": out / "work" / "prepare"})
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    check_machine(cfg)
    with _bench_scratch(out, keep_work) as scratch, _bench_progress() as progress:
        try:
            result = run_throughput_bench(
                cfg, seconds=seconds, work_dir=Path(scratch), compare=compare, progress=progress
            )
        except (RuntimeError, ValueError, FileNotFoundError) as exc:  # a stage failed: its log's end
            hint = "" if keep_work else " (rerun with --keep-work to keep the logs)"
            raise click.ClickException(f"bench throughput failed{hint}: {exc}") from None
    _finish_bench(result, out)


@bench.command("split")
@_run_options
@click.option("--gpus", help="The GPUs to split between the target and the drafters, e.g. 0-7 (CUDA).")
@click.option("--seconds", type=float, default=3.0, show_default=True, help="Measured seconds per probe.")
@click.option(
    "--verify", is_flag=True, help="Also run the pipeline at the pick and its two neighbouring splits."
)
@_OUT_OPTION
@_KEEP_OPTION
def bench_split(
    gpus: str | None, seconds: float, verify: bool, out_dir: Path | None, keep_work: bool, **opts
) -> None:
    """Which split of --gpus between target and drafters trains fastest, from a probe of each side.

    \b
    One target replica and one drafter are measured alone on the run's own target, drafter and data
    (with --responses target the replica's supply includes regenerating the replies); every split is
    predicted as min(target GPUs x supply, drafter GPUs x demand) and the best is picked and explained. On
    one GPU (or CPU) both sides share the device: the probe says the share of its time each needs.
    --verify runs the real pipeline at the pick and its neighbours (goal: the pick within 5% of the best).
      dflash-pipe bench split --target-model /models/Qwen3-8B --data chat.jsonl --gpus 0-7 --verify
      dflash-pipe bench split --seconds 2            # the demo on CPU: the share of the cores
    """
    from dflash_pipe.bench.split import run_split_bench
    from dflash_pipe.commands.launch_config import build_run_config
    from dflash_pipe.run.layout import parse_gpu_spec

    if seconds <= 0:
        raise click.UsageError(f"--seconds must be > 0, got {seconds}.")
    if opts.get("target_gpus") or opts.get("drafter_gpus"):
        raise click.UsageError(
            "bench split picks the split itself: give --gpus (e.g. 0-7), not --target-gpus/--drafter-gpus."
        )
    try:
        ids = parse_gpu_spec(gpus, flag="--gpus") if gpus else ()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if ids:
        opts.update(target_gpus=str(ids[0]), drafter_gpus=str(ids[-1]))  # the probe sets its own pair
    out = _bench_out(out_dir)
    try:
        cfg, _ = build_run_config({**opts, "run_dir": out / "work" / "prepare"})
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    if cfg.layout.device == "cuda" and not ids:
        raise click.UsageError("--gpus is needed on CUDA: the GPUs to split, e.g. 0-7.")
    check_machine(cfg)
    with _bench_scratch(out, keep_work) as scratch, _bench_progress() as progress:
        try:
            result = run_split_bench(
                cfg, gpus=ids, seconds=seconds, work_dir=Path(scratch), verify=verify, progress=progress
            )
        except (RuntimeError, ValueError, FileNotFoundError) as exc:
            hint = "" if keep_work else " (rerun with --keep-work to keep the logs)"
            raise click.ClickException(f"bench split failed{hint}: {exc}") from None
    console.print(f"pick: {result.summary['pick']}: {result.summary['why']}", markup=False, highlight=False)
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
    is faster; control_msgs_per_s is the encode + decode rate of the small control messages (CPU). Example:
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
@field_options(
    "target_model",
    "layout.device",
    "layout.drafter_gpus",
    "drafter.num_layers",
    overrides={
        "layout.drafter_gpus": {
            "help": "GPUs of the N workers started together, e.g. 0 or 0-3 (default: 0)."
        },
        "drafter.num_layers": {"help": "Drafter depth (default: 1 on CPU, 5 on CUDA)."},
    },
)
@click.option("--workers", type=int, default=2, show_default=True, help="N: workers started together.")
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
@click.option(
    "--warmup-batch-sizes",
    default="2,1",
    show_default=True,
    help="Batch sizes of each worker's warm-up; the first step runs at the first. 2,1 is a worker's own "
    "(size 1 compiles a second variant); 2 alone compiles one, about 2/3 of the CPU cost per cold start.",
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
    warmup_batch_sizes: str,
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
    from dflash_pipe.run.layout import parse_gpu_spec

    if workers < 1:
        raise click.UsageError(f"--workers must be >= 1, got {workers}.")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = parse_gpu_spec(drafter_gpus, flag="--drafter-gpus") if drafter_gpus else (0,)
    try:
        batch_sizes = tuple(int(b) for b in warmup_batch_sizes.split(",") if b.strip())
    except ValueError:
        raise click.UsageError(
            f"--warmup-batch-sizes takes integers like 2,1, got {warmup_batch_sizes!r}."
        ) from None
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
                warmup_batch_sizes=batch_sizes,
                work_dir=Path(scratch),
                progress=progress,
            )
        except (ValueError, FileNotFoundError) as exc:
            raise click.UsageError(str(exc)) from None
        except RuntimeError as exc:  # a worker start failed: the end of its log
            hint = "" if keep_work else " (rerun with --keep-work to keep the logs)"
            raise click.ClickException(f"bench compile failed{hint}: {exc}") from None
    _finish_bench(result, out)
