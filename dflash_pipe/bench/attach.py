"""What a run that grew by attached producers recorded: its supply and training rate per phase (how many
producers were in), its ledger, and the feature bytes of every link.

``bench/attach_supply.py`` runs such a run (the coordinator, then a producer attaching per phase, each node
pinned to its own cores) and ``bench/attached_producer_summary.py`` reads any run dir; both summarise here.
A phase starts when the coordinator's ``producers_attached`` changes; its first ``settle_s`` seconds are
left out, since the rates are sliding windows (``telemetry.rates.RateMeter``, 10 s) that still hold the
phase before.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_pipe.telemetry.metrics import read_metrics

SUPPLY_KEYS = ("tokens_per_s/producer", "tokens_per_s/attached_producers")
"""The coordinator's own produced tokens/s and the sum its attached producers last reported."""


@dataclass(frozen=True, slots=True)
class Phase:
    producers: int
    """Producers feeding the run: the coordinator and the attached ones."""
    start: float
    seconds: float
    """Wall time from the phase's first record to the next phase's (or the run's last record)."""
    supply_tokens_per_s: float | None
    """Median produced tokens/s of the settled records (coordinator + attached)."""
    trained_tokens_per_s: float | None
    """Median trained tokens/s of the settled records."""
    records: int
    """Settled supply records the medians come from."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A metrics.jsonl's records (``telemetry.metrics.read_metrics``: a last line still being written is
    skipped), or [] before the run wrote one."""
    return read_metrics(path) if path.exists() else []


def phases(rows: list[dict[str, Any]], *, settle_s: float = 12.0) -> list[Phase]:
    """The coordinator's records cut where ``producers_attached`` changes."""
    marks = [(r["time"], int(r["producers_attached"])) for r in rows if "producers_attached" in r]
    if not marks:
        return []
    bounds: list[tuple[float, int]] = [marks[0]]
    for t, n in marks[1:]:
        if n != bounds[-1][1]:
            bounds.append((t, n))
    end = max(r["time"] for r in rows)
    out = []
    for i, (start, attached) in enumerate(bounds):
        stop = bounds[i + 1][0] if i + 1 < len(bounds) else end
        settled = [r for r in rows if start + settle_s <= r["time"] < stop]
        supply = [
            sum(r.get(k, 0.0) for k in SUPPLY_KEYS)
            for r in settled
            if SUPPLY_KEYS[0] in r and (attached == 0 or r.get(SUPPLY_KEYS[1], 0.0) > 0)
        ]
        trained = [r["tokens_per_s"] for r in settled if r.get("tokens_per_s", 0.0) > 0]
        out.append(
            Phase(
                producers=1 + attached,
                start=start,
                seconds=stop - start,
                supply_tokens_per_s=statistics.median(supply) if supply else None,
                trained_tokens_per_s=statistics.median(trained) if trained else None,
                records=len(supply),
            )
        )
    return out


def last_value(rows: list[dict[str, Any]], key: str) -> float:
    return max((r[key] for r in rows if key in r), default=0.0)


def summarize(run_dir: Path, producers: list[str], *, settle_s: float = 12.0) -> dict[str, Any]:
    """The ledger of the run's last checkpoint, the feature bytes per link (each producer's own, local to
    its node or remote), the plan bytes, and the phases."""
    from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
    from dflash_pipe.run.dir import RunDir
    from dflash_pipe.run.ledger import Ledger

    state = read_trainer_state(latest_checkpoint(run_dir))
    ledger = Ledger.from_dict(state.ledger)
    rows = read_rows(RunDir(run_dir).metrics)
    attached_local = {p: last_value(rows, f"producer/{p}/wire/feature_bytes_local") for p in producers}
    trained = [ledger.count(e) for e in range(ledger.epochs)]
    return {
        "steps": state.step,
        "num_samples": ledger.num_samples,
        "samples_trained_per_epoch": [n for n in trained if n],
        "duplicates": ledger.duplicates,
        "complete_epochs": sum(ledger.complete(e) for e in range(ledger.epochs)),
        "feature_bytes": {
            "coordinator_local": last_value(rows, "wire/feature_bytes_local") - sum(attached_local.values()),
            **{f"{p}_local": v for p, v in attached_local.items()},
            "remote_total": last_value(rows, "wire/feature_bytes_remote"),
        },
        "plan_bytes_to_attached": last_value(rows, "wire/plan_bytes"),
        "batches_via": {
            p: {
                "shm": last_value(rows, f"producer/{p}/batches_via_shm"),
                "cuda_ipc": last_value(rows, f"producer/{p}/batches_via_cuda_ipc"),
            }
            for p in producers
        },
        "phases": [asdict(p) for p in phases(rows, settle_s=settle_s)],
    }
