"""What every bench returns: rows of figures plus the config that produced them.

Saving (JSON with provenance, a PNG chart) and showing (a rich table) live beside this in the bench
package, so each bench only measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class BenchResult:
    name: str
    """Short id, also the results file stem: "transport", "throughput", "compile"."""
    config: dict[str, Any]
    """Everything that shaped the figures (sizes, devices, model, seconds), JSON-serialisable."""
    rows: list[dict[str, Any]]
    """One dict per measured case; same keys in every row (a table's columns)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Headline ratios and goal checks, e.g. {"pipeline_efficiency": 0.97, "goal_efficiency": 0.95}."""
    chart: dict[str, str] = field(default_factory=dict)
    """How to plot rows: {"x": column, "y": column, "group": column (optional), "title": text}."""
