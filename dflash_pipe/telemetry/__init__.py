"""Telemetry: metrics sinks, timing spans and the live dashboard (drawn only by the process owning the terminal)."""

from dflash_pipe.telemetry.dashboard import Dashboard, RunState, WorkerRow, sparkline, summary_table
from dflash_pipe.telemetry.metrics import (
    JsonlSink,
    MetricsLogger,
    MetricsSink,
    TensorBoardSink,
    WandbSink,
    make_logger,
    read_metrics,
)
from dflash_pipe.telemetry.spans import RateMeter, SpanStats, SpanSummary, span

__all__ = [
    "Dashboard",
    "JsonlSink",
    "MetricsLogger",
    "MetricsSink",
    "RateMeter",
    "RunState",
    "SpanStats",
    "SpanSummary",
    "TensorBoardSink",
    "WandbSink",
    "WorkerRow",
    "make_logger",
    "read_metrics",
    "span",
    "sparkline",
    "summary_table",
]
