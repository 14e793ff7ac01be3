"""Telemetry: metrics sinks, rate meters and the live dashboard (drawn only by the process owning the terminal)."""

from __future__ import annotations

from dflash_pipe import lazy_exports

# Names load on first use (PEP 562): importing one submodule never runs the others (no cycle through
# this file), and ``from dflash_pipe.telemetry import Name`` works as with eager imports.
_FROM = {
    ".dashboard": ("Dashboard", "RunState", "WorkerRow", "latest_per_step", "sparkline", "summary_table"),
    ".gpu": ("GpuMemoryProbe",),
    ".metrics": (
        "JsonlSink",
        "MetricsLogger",
        "MetricsSink",
        "TensorBoardSink",
        "WandbSink",
        "make_logger",
        "read_metrics",
        "sink_problem",
    ),
    ".rates": ("RateMeter", "TimeShares"),
}
_EXPORTS = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
