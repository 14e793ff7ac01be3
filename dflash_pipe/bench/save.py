"""Saving and showing a BenchResult: JSON with provenance, a PNG chart, a rich table with goal checks.

Every bench measures and returns a ``BenchResult``; this module is the only place that writes or prints
one, so all result files share one shape: ``{"name", "provenance", "config", "rows", "summary", "chart"}``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dflash_pipe.bench.result import BenchResult

_VERSIONED = ("dflash-pipe", "torch", "transformers", "triton", "pyzmq")


def goal(
    name: str, value: float | None, *, at_least: float | None = None, at_most: float | None = None
) -> dict:
    """One goal check for ``BenchResult.summary["goals"]``: the figure, its bound and whether it is met.

    ``value`` None (the figure could not be measured) is reported as not met, never as met."""
    if (at_least is None) == (at_most is None):
        raise ValueError(f"goal {name!r}: give exactly one of at_least or at_most.")
    bound = at_least if at_least is not None else at_most
    op = ">=" if at_least is not None else "<="
    met = value is not None and (value >= bound if op == ">=" else value <= bound)
    return {"name": name, "value": value, "op": op, "bound": bound, "met": bool(met)}


def provenance() -> dict[str, Any]:
    """Where and with what a figure was measured: commit, versions, CPU, GPUs, host, time."""
    versions = {}
    for dist in _VERSIONED:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    gpus: list[str] = []
    if "torch" in sys.modules or versions["torch"]:
        import torch

        versions["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "git_sha": _git_sha(),
        "versions": versions,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "gpu_count": len(gpus),
        "gpus": gpus,
        "hostname": socket.gethostname(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _git_sha() -> str | None:
    """The commit of the dflash_pipe source in use (None outside a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=5,
    )
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def result_dict(result: BenchResult, *, prov: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": result.name,
        "provenance": prov if prov is not None else provenance(),
        "config": result.config,
        "rows": result.rows,
        "summary": result.summary,
        "chart": result.chart,
    }


def load_result(path: Path) -> tuple[BenchResult, dict[str, Any]]:
    """A saved result file back as (BenchResult, provenance)."""
    data = json.loads(Path(path).read_text())
    missing = sorted({"name", "config", "rows"} - set(data))
    if missing:
        raise ValueError(f"{path}: not a bench result file (missing {missing}); bench commands write them.")
    result = BenchResult(
        name=data["name"],
        config=data["config"],
        rows=data["rows"],
        summary=data.get("summary", {}),
        chart=data.get("chart", {}),
    )
    return result, data.get("provenance", {})


def save_result(result: BenchResult, out_dir: Path) -> dict[str, Path]:
    """Writes OUT_DIR/<name>.json (provenance + figures) and OUT_DIR/<name>.png; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{result.name}.json"
    json_path.write_text(json.dumps(_finite(result_dict(result)), indent=2) + "\n")
    paths = {"json": json_path}
    if result.chart:
        paths["png"] = render_chart(result, out_dir / f"{result.name}.png")
    return paths


def _finite(value: Any) -> Any:
    """NaN/inf become null, so the file is strict JSON."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def render_chart(result: BenchResult, path: Path) -> Path:
    """Bars (x categories, one bar per group) or lines (numeric x, one line per group) of ``result.chart``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chart = result.chart
    x_key, y_key, group_key = chart["x"], chart["y"], chart.get("group")
    rows = [r for r in result.rows if isinstance(r.get(y_key), (int, float)) and r.get(x_key) is not None]
    groups = list(dict.fromkeys(r.get(group_key) for r in rows)) if group_key else [None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if chart.get("kind", "bar") == "line":
        for g in groups:
            pts = sorted((r[x_key], r[y_key]) for r in rows if group_key is None or r.get(group_key) == g)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=None if g is None else str(g))
        if chart.get("log_x"):
            ax.set_xscale("log", base=2)
    else:
        cats = list(dict.fromkeys(str(r[x_key]) for r in rows))
        width = 0.8 / max(len(groups), 1)
        for gi, g in enumerate(groups):
            values = {str(r[x_key]): r[y_key] for r in rows if group_key is None or r.get(group_key) == g}
            xs = [i + (gi - (len(groups) - 1) / 2) * width for i in range(len(cats))]
            ax.bar(xs, [values.get(c, 0.0) for c in cats], width, label=None if g is None else str(g))
        ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
    ax.set_xlabel(chart.get("x_label", x_key))
    ax.set_ylabel(chart.get("y_label", y_key))
    ax.set_title(chart.get("title", result.name))
    if group_key:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def show_result(result: BenchResult, console: Console) -> None:
    """The rows as a rich table, then the summary's figures and each goal as met / not met."""
    columns = list(dict.fromkeys(k for row in result.rows for k in row))
    table = Table(title=f"dflash-pipe bench {result.name}", show_header=True)
    for col in columns:
        numeric = any(isinstance(r.get(col), (int, float)) for r in result.rows)
        table.add_column(col, justify="right" if numeric else "left")
    for row in result.rows:
        table.add_row(*(format_value(row.get(col)) for col in columns))
    print_whole(console, table)
    for key, value in result.summary.items():
        if key in ("goals", "notes"):
            continue
        console.print(f"{key}: {format_value(value)}")
    for note in result.summary.get("notes", []):
        console.print(f"note: {note}")
    for g in result.summary.get("goals", []):
        verdict = "[green]met[/]" if g["met"] else "[red]not met[/]"
        console.print(
            f"goal {g['name']}: {format_value(g['value'])} (goal {g['op']} {g['bound']}): {verdict}"
        )


def print_whole(console: Console, table: Table) -> None:
    """Print `table` at its natural width where the output is not a terminal.

    A bench's console usually goes to a log (a device call, CI); there rich assumes 80 columns and squeezes a
    wide table into columns of ellipses, losing every figure. A terminal keeps its own width.
    """
    if console.is_terminal:
        console.print(table)
        return
    unbounded = console.options.update(width=1_000_000, max_width=1_000_000)
    natural = console.measure(table, options=unbounded).maximum
    width = console.width
    console.width = max(width, natural)
    try:
        console.print(table)
    finally:
        console.width = width


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={format_value(v)}" for k, v in value.items())
    return str(value)
