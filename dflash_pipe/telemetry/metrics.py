"""Metrics logging: one `log(metrics, step)` interface with JSONL / TensorBoard / W&B sinks behind it.

Only the process that owns the run (the producer, or a benchmark) logs; workers send METRICS messages to it.
JSONL is the source of truth (always written, readable while the run is going, appended to on resume);
TensorBoard and W&B are optional mirrors whose packages are imported only when asked for.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from dflash_pipe.diskspace import is_no_space, no_space_error
from dflash_pipe.telemetry.gpu import GpuMemoryProbe

MetricValue: TypeAlias = float | int | list[float]
Metrics: TypeAlias = Mapping[str, float | int | Sequence[float]]

SINK_KINDS = ("jsonl", "tensorboard", "wandb")
_RESERVED_KEYS = frozenset({"step", "time"})


class MetricsSink(Protocol):
    """What every sink (and the fan-out `MetricsLogger`) provides."""

    def log(self, metrics: dict[str, MetricValue], step: int) -> None: ...

    def close(self) -> None: ...


def _normalize(metrics: Metrics, step: int) -> dict[str, MetricValue]:
    """Check keys/values once so every sink sees the same plain Python numbers (no tensors, no numpy)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"metrics step must be an int >= 0, got {step!r}; pass the optimizer step count")
    out: dict[str, MetricValue] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric names must be non-empty strings, got {key!r}")
        if key in _RESERVED_KEYS:
            raise ValueError(f"metric name {key!r} is reserved (the JSONL record sets it); rename the metric")
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
        elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
            try:
                out[key] = [float(v) for v in value]
            except (TypeError, ValueError):
                raise ValueError(
                    f"metric {key!r} must be a list of numbers, got {value!r}; convert tensors with .tolist()"
                ) from None
        else:
            raise ValueError(
                f"metric {key!r} must be a float, int or list of floats, got {type(value).__name__}; "
                "convert tensors with .item() / .tolist() before logging"
            )
    return out


def _json_safe(value: MetricValue) -> Any:
    """NaN/inf become null: strict JSON that jq, pandas and browsers all read."""
    if isinstance(value, list):
        return [v if math.isfinite(v) else None for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _flatten(metrics: Mapping[str, MetricValue]) -> Iterable[tuple[str, float]]:
    """Scalar view for sinks without list support: list metrics become `name/slot_<i>`."""
    for key, value in metrics.items():
        if isinstance(value, list):
            for i, v in enumerate(value):
                yield f"{key}/slot_{i}", v
        else:
            yield key, float(value)


class JsonlSink:
    """One JSON object per line: {"step", "time" (unix seconds), **metrics}; flushed per line.

    Opened in append mode so a resumed run continues the same file. A partial last line left by a killed
    writer is cut off first, so the next record starts on a clean line. Non-finite values are written as null.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_tail(self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, MetricValue], step: int) -> None:
        """A full disk is ``DiskFullError`` (one line: the file, the bytes, what to do)."""
        record = {"step": step, "time": time.time()}
        record.update((k, _json_safe(v)) for k, v in metrics.items())
        line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as exc:
            if is_no_space(exc, self.path, len(line)):
                raise no_space_error(
                    self.path,
                    len(line),
                    what="a metrics record",
                    fix="Free space there or move the run dir to a larger disk, then resume with "
                    "`dflash-pipe launch --resume RUN_DIR` (a record cut short is dropped on resume)",
                ) from None
            raise

    def close(self) -> None:
        if not self._file.closed:
            with contextlib.suppress(OSError):  # a full disk was already reported by log
                self._file.close()


def _drop_partial_tail(path: Path) -> None:
    """Truncate bytes after the last newline (a record cut short when the previous writer died)."""
    if not path.exists():
        return
    with path.open("rb+") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        if keep != end:
            f.truncate(keep)


class TensorBoardSink:
    """Scalars into TensorBoard event files; list metrics become `name/slot_<i>`. Needs `tensorboard`."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError(
                f"metrics sink 'tensorboard' needs tensorboard ({e}); fix: pip install tensorboard"
            ) from e
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)
        self._closed = False

    def log(self, metrics: dict[str, MetricValue], step: int) -> None:
        for key, value in _flatten(metrics):
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.flush()
            self._writer.close()


class WandbSink:
    """Weights & Biases run; list metrics become `name/slot_<i>`. Needs `wandb` (and a login or offline mode)."""

    def __init__(
        self, project: str, run_name: str, config: dict | None = None, *, save_dir: str | Path | None = None
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ValueError(f"metrics sink 'wandb' needs wandb ({e}); fix: pip install wandb") from e
        self._run = wandb.init(
            project=project,
            name=run_name,
            config=config or {},
            dir=None if save_dir is None else str(save_dir),
        )
        self._closed = False

    def log(self, metrics: dict[str, MetricValue], step: int) -> None:
        self._run.log(dict(_flatten(metrics)), step=step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._run.finish()


class MetricsLogger:
    """Fan-out to sinks. Values are validated once; thread-safe (IO threads may log); `close()` is idempotent.

    ``extra`` (e.g. `GpuMemoryProbe.probe`) is called on every log and its values join the record.
    """

    def __init__(self, sinks: Sequence[MetricsSink], *, extra: Callable[[], Metrics] | None = None) -> None:
        self.sinks = list(sinks)
        self._extra = extra
        self._lock = threading.Lock()
        self._closed = False

    def log(self, metrics: Metrics, step: int) -> None:
        if self._extra is not None:
            metrics = {**self._extra(), **metrics}
        clean = _normalize(metrics, step)
        with self._lock:
            if self._closed:
                raise RuntimeError("MetricsLogger.log() after close(); log before closing the run")
            for sink in self.sinks:
                sink.log(clean, step)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors = []
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception as e:  # close the others anyway, then report
                    errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sink_problem(kind: str) -> str | None:
    """Why the sink ``kind`` cannot be used here (unknown, package missing), or None when it can."""
    try:
        _check_available(kind)
    except ValueError as e:
        return str(e)
    return None


def _check_available(kind: str) -> None:
    """Fail before any sink is opened, so a bad kind never leaves half-created files behind."""
    if kind not in SINK_KINDS:
        raise ValueError(f"unknown metrics sink kind {kind!r}; choose from {', '.join(SINK_KINDS)}")
    if kind == "tensorboard":
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"metrics sink 'tensorboard' is not available ({e}); fix: pip install tensorboard"
            ) from e
    elif kind == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError as e:
            raise ValueError(f"metrics sink 'wandb' is not available ({e}); fix: pip install wandb") from e


def make_logger(
    metrics_file: str | Path,
    kinds: Sequence[str] = ("jsonl",),
    config: dict | None = None,
    *,
    tensorboard_dir: str | Path | None = None,
    wandb_project: str = "dflash-pipe",
    gpu_devices: Sequence[str] = (),
) -> MetricsLogger:
    """Logger for a run: the JSONL file ``metrics_file`` always, plus TensorBoard (into ``tensorboard_dir``)
    and/or W&B. The run's paths come from its caller (a run dir's are ``RunDir.metrics`` and
    ``RunDir.tensorboard``), so this module spells none of them.

    JSONL is added even when `kinds` omits it: the end-of-run summary and `read_metrics` rely on it.
    `config` goes to W&B (the resolved run config); the W&B run is named after the folder of
    `metrics_file` and saves there. `gpu_devices` (``cuda:N``; others are ignored): their memory joins every
    record (see `GpuMemoryProbe`).
    """
    if isinstance(kinds, str):
        raise ValueError(
            f"kinds must be a sequence of sink names, got the string {kinds!r}; use ({kinds!r},)"
        )
    wanted = list(dict.fromkeys(["jsonl", *kinds]))
    for kind in wanted:
        _check_available(kind)
    if "tensorboard" in wanted and tensorboard_dir is None:
        raise ValueError(
            f"metrics sink 'tensorboard' for {metrics_file} needs a folder to write into: pass tensorboard_dir"
        )
    metrics_file = Path(metrics_file)
    folder = metrics_file.parent
    sinks: list[MetricsSink] = []
    try:
        for kind in wanted:
            if kind == "jsonl":
                sinks.append(JsonlSink(metrics_file))
            elif kind == "tensorboard":
                sinks.append(TensorBoardSink(Path(tensorboard_dir)))
            else:
                sinks.append(WandbSink(wandb_project, folder.name, config, save_dir=folder))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    probe = GpuMemoryProbe(gpu_devices)
    return MetricsLogger(sinks, extra=probe.probe if probe else None)


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics JSONL, in file order (a resumed run may repeat steps; later lines win).

    A last line without its newline that does not parse is a record still being written: it is skipped.
    Any other bad line raises ValueError naming the file and line.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records: list[dict] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines):  # no trailing newline: partial record of a running writer
                break
            raise ValueError(
                f"{path}:{lineno}: not a JSON object ({e}); the metrics file is corrupt"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records
