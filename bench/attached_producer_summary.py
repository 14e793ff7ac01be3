"""What a run with an attaching producer recorded, as JSON: the ledger of its last checkpoint (every sample
of every epoch trained once?), the bytes of each link, and the supply before and after the producer
attached (the coordinator's own tokens/s, then its own plus the attached producers').

    python bench/attached_producer_summary.py RUN_DIR [--producer NAME] > summary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.run.ledger import Ledger


def rows(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def summarize(run_dir: Path, producer: str) -> dict:
    state = read_trainer_state(latest_checkpoint(run_dir))
    ledger = Ledger.from_dict(state.ledger)
    coordinator = rows(run_dir / "metrics.jsonl")
    attached = rows(run_dir / "producers" / producer / "metrics.jsonl")
    trained = [r for r in coordinator if "tokens_per_s/producer" in r and "producers_attached" in r]
    alone = [r["tokens_per_s/producer"] for r in trained if r["producers_attached"] == 0]
    together = [
        r["tokens_per_s/producer"] + r.get("tokens_per_s/attached_producers", 0.0)
        for r in trained
        if r["producers_attached"] >= 1 and r.get("tokens_per_s/attached_producers", 0.0) > 0
    ]

    def last(values: list[dict], key: str) -> float:
        return max((r[key] for r in values if key in r), default=0.0)

    prefix = f"producer/{producer}/"
    return {
        "steps": state.step,
        "samples_per_epoch": [ledger.count(e) for e in range(ledger.epochs)],
        "num_samples": ledger.num_samples,
        "every_sample_once": all(ledger.complete(e) for e in range(ledger.epochs)) and ledger.duplicates == 0,
        "duplicates": ledger.duplicates,
        "feature_bytes": {
            "coordinator_local": last(coordinator, "wire/feature_bytes_local")
            - last(coordinator, prefix + "wire/feature_bytes_local"),
            f"{producer}_local": last(coordinator, prefix + "wire/feature_bytes_local"),
            "remote_total": last(coordinator, "wire/feature_bytes_remote"),
        },
        "plan_bytes_to_attached": last(coordinator, "wire/plan_bytes"),
        f"{producer}_batches_via": {
            "cuda_ipc": last(attached, "batches_via_cuda_ipc"),
            "shm": last(attached, "batches_via_shm"),
        },
        "supply_tokens_per_s": {
            "coordinator_alone_median": statistics.median(alone) if alone else None,
            "with_attached_median": statistics.median(together) if together else None,
            "records": [len(alone), len(together)],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--producer", default="node1")
    args = parser.parse_args()
    print(json.dumps(summarize(args.run_dir, args.producer), indent=2))


if __name__ == "__main__":
    main()
