"""RUN_DIR/producer.json: where the producer listens and which worker processes it started.

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
