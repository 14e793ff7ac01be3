"""RUN_DIR/producer.json: where the producer listens, which worker processes it started and whether a launch
trained every epoch.

A resumed producer (``launch --resume``) binds the address recorded here, so workers that outlived a
killed producer reconnect to the same place, and the launcher adopts those workers instead of starting
second ones on the same devices.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash_pipe.run.files import RECORD_FILE


def read_record(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / RECORD_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_record(run_dir: Path, **fields: Any) -> None:
    """Merges ``fields`` into the record, atomically (temp file + rename)."""
    path = Path(run_dir) / RECORD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**read_record(run_dir), **fields, "pid": os.getpid()}
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def bind_address(run_dir: Path, configured: str) -> str:
    """The configured address, unless it asks for any free port (``:0``) and this run already listened
    somewhere: then that same address, so the run's workers find it again."""
    recorded = read_record(run_dir).get("address")
    if recorded and configured.endswith(":0") and configured.rsplit(":", 1)[0] == recorded.rsplit(":", 1)[0]:
        return recorded
    return configured


COMPLETE_KEY = "complete"
"""RUN_DIR/producer.json key: the checkpoint and epoch count of a launch that trained every epoch."""


def record_complete(run_dir: Path, *, checkpoint: str | None, epochs: int) -> None:
    """Written when a launch trained every epoch: a later resume of that checkpoint knows the run is complete
    without the data (regenerated conversations with nothing to train never fill the ledger)."""
    if checkpoint:
        write_record(run_dir, **{COMPLETE_KEY: {"checkpoint": Path(checkpoint).name, "epochs": epochs}})


def recorded_complete(run_dir: Path, checkpoint: Path, epochs: int) -> bool:
    """Whether a launch recorded ``checkpoint`` as having trained ``epochs`` epochs or more."""
    done = read_record(run_dir).get(COMPLETE_KEY) or {}
    return done.get("checkpoint") == checkpoint.name and epochs <= int(done.get("epochs", 0))
