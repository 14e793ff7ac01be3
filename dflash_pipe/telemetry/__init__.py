"""Telemetry: metrics sinks, rate meters and the live dashboard (drawn only by the process owning the terminal)."""

from dflash_pipe.telemetry.dashboard import (
    Dashboard,
    RunState,
    WorkerRow,
    latest_per_step,
    sparkline,
    summary_table,
)
from dflash_pipe.telemetry.gpu import GpuMemoryProbe
from dflash_pipe.telemetry.metrics import (
    JsonlSink,
    MetricsLogger,
    MetricsSink,
    TensorBoardSink,
    WandbSink,
    make_logger,
    read_metrics,
    sink_problem,
)
from dflash_pipe.telemetry.rates import RateMeter, TimeShares

__all__ = [
    "Dashboard",
    "GpuMemoryProbe",
    "JsonlSink",
    "MetricsLogger",
    "MetricsSink",
    "RateMeter",
    "RunState",
    "TensorBoardSink",
    "TimeShares",
    "WandbSink",
    "WorkerRow",
    "latest_per_step",
    "make_logger",
    "read_metrics",
    "sink_problem",
    "sparkline",
    "summary_table",
]
