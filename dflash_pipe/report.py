"""What a run's metrics say: the end-of-run summary, and `dflash-pipe report`'s PNG curves and table.

Everything is read from RUN_DIR/metrics.jsonl, so it works on a finished run and on one still writing
(a half-written last line is skipped). matplotlib is used with the Agg backend: no display needed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dflash_pipe.producer.display import data_lines
from dflash_pipe.run.dir import RunDir
from dflash_pipe.telemetry import latest_per_step, read_metrics, summary_table

FIRST_STEP = "time_to_first_step_s/"


def print_summary(run_dir: Path, summary: Any, console: Console) -> None:
    rows = read_metrics(RunDir(run_dir).metrics)
    console.print(summary_table(rows, title=f"run summary: {run_dir}"))
    table = Table(title="workers", show_header=True)
    table.add_column("worker")
    table.add_column("time to first step", justify="right")
    for name, seconds in sorted(summary.first_step_s.items()):
        table.add_row(name, f"{seconds:.1f} s")
    console.print(table)
    tokens_s = summary.acked_tokens / summary.wall_s if summary.wall_s else 0.0
    console.print(
        f"{steps_text(summary)} in {summary.wall_s:.0f} s ({tokens_s:,.0f} tokens/s overall, "
        f"{summary.steady_tokens_per_s:,.0f} tokens/s after the first step); "
        f"stopped: {summary.stop_reason}; last checkpoint: {summary.last_checkpoint}",
        markup=False,
        highlight=False,
    )
    regen = getattr(summary, "regen", None)
    if regen:
        console.print(regen_line(regen), markup=False, highlight=False)
    data = getattr(summary, "data", None)
    if data:
        for line in data_lines(data):
            console.print(line, markup=False, highlight=False)


def steps_text(summary: Any) -> str:
    """The steps of this launch: ``5 steps`` for a fresh run, ``trained 40 steps this launch (step 100 ->
    140)`` for a resumed one."""
    start = getattr(summary, "start_step", 0)
    if not start:
        return _count(summary.steps, "step")
    return f"trained {_count(summary.steps - start, 'step')} this launch (step {start} -> {summary.steps})"


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def regen_line(regen: Mapping[str, Any]) -> str:
    """The summary's regeneration line (``ProducerSummary.regen``)."""
    failed = ", ".join(f"{n} {why}" for why, n in sorted(regen["failed_turns"].items())) or "none"
    rate = regen["new_tokens"] / regen["seconds"] if regen["seconds"] > 0 else 0.0
    return (
        f"regenerated: {regen['conversations_generated']} conversations now ({regen['conversations_reused']} "
        f"reused from {regen['file']}), {regen['turns']} turns ({regen['truncated_turns']} cut at the token "
        f"limit{_capped_looped(regen)}), failed turns: {failed} ({regen['skipped_turns']} turns left out), "
        f"{regen['dropped_conversations']} conversations with nothing to train{_rendered(regen)}; "
        f"{regen['new_tokens']:,} tokens, "
        f"{regen['seconds']:.0f} s from the first job to the last reply ({rate:,.0f} generated tokens/s)"
    )


def _rendered(regen: Mapping[str, Any]) -> str:
    """``, 3 trained from their text ...`` when some conversations' ids did not chain (nothing otherwise)."""
    n = regen.get("rendered_conversations", 0)
    if not n:
        return ""
    return (
        f", {n} trained from their text re-tokenized (the chat template rewrote an earlier turn or a reply's "
        "text tokenizes otherwise; the rest train the target's own ids)"
    )


def _capped_looped(regen: Mapping[str, Any]) -> str:
    """``: 75 at --max-new-tokens 512; 70 ending in a loop`` (nothing for a summary made before they were
    counted)."""
    if "capped_turns" not in regen:
        return ""
    cap = f" {regen['max_new_tokens']}" if "max_new_tokens" in regen else ""
    return f": {regen['capped_turns']} at --max-new-tokens{cap}; {regen['looped_turns']} ending in a loop"


def report(run_dir: Path, out_dir: Path | None, console: Console) -> list[Path]:
    """`dflash-pipe report`: write the curves, print the summary table and where the PNGs went."""
    run_dir = Path(run_dir)
    path = RunDir(run_dir).metrics
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: give a run directory (`launch` prints it; default runs/<time>)."
        )
    rows = read_metrics(path)
    written = render_curves(rows, out_dir or RunDir(run_dir).report)
    console.print(summary_table(rows, title=f"run: {run_dir}"))
    firsts = {k[len(FIRST_STEP) :]: v for r in rows for k, v in r.items() if k.startswith(FIRST_STEP)}
    if firsts:
        console.print("time to first step: " + ", ".join(f"{n} {v:.1f} s" for n, v in sorted(firsts.items())))
    for png in written:
        console.print(f"wrote {png}")
    return written


def render_curves(rows: Sequence[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    """loss.png, accuracy.png, tau.png, throughput.png (and gpu_memory.png when logged) from metrics records.

    Every PNG is written even before its metric exists (with a note saying so), so a report of a run that
    just started has the same files as one of a finished run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = latest_per_step(rows)
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    # loss (and the LR schedule on a second axis)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _plot(ax, rows, "loss", label="loss", empty="no loss logged yet")
    ax.set_title("training loss")
    ax.set_ylabel("loss")
    steps, lrs = _series(rows, "lr")
    if steps:
        ax2 = ax.twinx()
        ax2.plot(steps, lrs, color="tab:gray", alpha=0.5, linewidth=1, label="lr")
        ax2.set_ylabel("learning rate", color="tab:gray")
    save(fig, "loss.png")

    # accuracy: mean over slots by step, and each slot at the last step
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    acc_rows = [r for r in rows if isinstance(r.get("acc"), list) and r["acc"]]
    if acc_rows:
        means = [_mean_scored(r["acc"]) for r in acc_rows]
        left.plot([r["step"] for r in acc_rows], means, marker="." if len(acc_rows) < 30 else None)
        last = acc_rows[-1]["acc"]
        right.bar(range(1, len(last) + 1), [v if v is not None else math.nan for v in last])
        right.set_xlabel(f"block slot (slot k predicts anchor + k; step {acc_rows[-1]['step']})")
        right.set_ylim(0, 1)
    else:
        _note(left, "no accuracy logged yet")
        _note(right, "no accuracy logged yet")
    left.set_title("draft-token accuracy, mean of scored slots")
    left.set_xlabel("step")
    right.set_title("accuracy per slot")
    save(fig, "accuracy.png")

    # tau
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _plot(
        ax,
        rows,
        "simulated/tau",
        label="simulated (teacher-forced)",
        marker="o",
        empty="no tau yet: evaluated at the end of the run, or every --eval-every steps",
    )
    _plot(ax, rows, "real/tau", label="real (speculative decoding)", marker="s")
    ax.set_title("acceptance length (tau), greedy: simulated and real")
    save(fig, "tau.png")

    # throughput per stage, and the queues between them
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    stages = sorted({k for r in rows for k in r if k.startswith("tokens_per_s/")})
    for key in stages:
        _plot(top, rows, key, label=key.split("/", 1)[1])
    if not stages:
        _plot(top, rows, "tokens_per_s", label="trained", empty="no throughput logged yet")
    top.set_title("tokens/s per stage")
    top.set_ylabel("tokens/s")
    for key, label in (("queue_depth", "ready batches (queue depth)"), ("leased", "leased batches")):
        _plot(bottom, rows, key, label=label, empty="no queue depths logged yet" if key == "leased" else None)
    bottom.set_title("queues")
    save(fig, "throughput.png")

    mem_keys = sorted({k for r in rows for k in r if k.startswith("gpu_mem_")})
    if mem_keys:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for key in mem_keys:
            _plot(ax, rows, key, label=key)
        ax.set_title("GPU memory")
        ax.set_ylabel("GiB")
        save(fig, "gpu_memory.png")
    return written


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    have = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return [s for s, _ in have], [float(v) for _, v in have]


def _plot(ax, rows, key: str, *, label: str, marker: str | None = None, empty: str | None = None) -> None:
    steps, values = _series(rows, key)
    if steps:
        ax.plot(steps, values, label=label, marker=marker or ("." if len(steps) < 30 else None))
        ax.legend(loc="best")
    elif empty:
        _note(ax, empty)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray", wrap=True)


def _mean_scored(acc: Sequence[float | None]) -> float:
    scored = [v for v in acc if v is not None and math.isfinite(v)]
    return sum(scored) / len(scored) if scored else math.nan
