"""A recipe sweep read back: how far each short training run got, from its own ``metrics.jsonl``.

Runs of a sweep train on the same file with the same seed, so their batches come in the same order and their
curves compare step for step; what a row says is where a run stood at its end (the mean of its last
``tail`` share of steps, which smooths the batch-to-batch noise of real data), how fast it got there, and
the simulated tau of the held-out samples at its end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def read_metrics(metrics: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def sweep_row(name: str, args: Sequence[str], metrics: Path, *, tail: float = 0.2) -> dict[str, Any]:
    """One run of the sweep: its arguments, steps, seconds from its first step to its last, and its loss
    and per-slot accuracy averaged over the last ``tail`` of its steps; ``steps`` 0 when it never trained."""
    if not 0 < tail <= 1:
        raise ValueError(f"tail must be in (0, 1], got {tail}")
    everything = read_metrics(metrics) if metrics.is_file() else []
    records = [r for r in everything if "loss" in r and "acc" in r]
    row: dict[str, Any] = {"name": name, "args": list(args), "steps": len(records)}
    if not records:
        return row
    last = records[-max(1, round(len(records) * tail)) :]
    acc = np.mean([r["acc"] for r in last], axis=0)
    row.update(
        steps=int(records[-1]["step"]),
        train_s=float(records[-1]["time"] - records[0]["time"]),
        loss=float(np.mean([r["loss"] for r in last])),
        acc=[round(float(a), 4) for a in acc],
        acc_mean=float(acc.mean()),
        tail_steps=len(last),
    )
    if simulated := [r for r in everything if "simulated/tau" in r]:  # the held-out samples' at the end
        row["simulated_tau"] = float(simulated[-1]["simulated/tau"])
    return row
