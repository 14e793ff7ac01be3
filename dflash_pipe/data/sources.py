"""What ``--data`` names: a JSONL file, a file holding one JSON array of records, or a table (parquet / arrow files, a ``save_to_disk`` folder, a Hub
dataset id in the local cache) that is read in record batches.

``resolve_source`` decides once, before anything is read, and every reader (the loader, regeneration,
provenance) takes its answer, so they all read the same rows in the same order. Only looking at the path
happens here; the ``datasets`` library (the optional ``data`` extra) is imported by ``hub.py`` when a
table is named, never for JSONL.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

from .arrays import is_json_array
from .resolved import ARROW, PARQUET, HubSpec, JsonArraySource, JsonlSource, Source
from .samples import DataError

TABLE_SUFFIXES = {".parquet": PARQUET, ".arrow": ARROW}
"""File name endings read as tables; any other file is JSONL, or a JSON array when its first non-space byte
is ``[``."""
_MAGIC = ((b"PAR1", PARQUET), (b"ARROW1", ARROW), (b"\xff\xff\xff\xff", ARROW))
"""First bytes of a parquet file, an arrow IPC file and an arrow IPC stream (``datasets`` writes streams)."""
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<a>[\w.-]+))?(?::(?P<b>[\w.-]+))?$")
"""``ORG/NAME``, ``ORG/NAME:SPLIT`` or ``ORG/NAME:CONFIG:SPLIT``."""
ACCEPTED = (
    "Pass a JSONL file, a JSON array file, a parquet or arrow file, a folder or glob of parquet/arrow shards, a "
    "datasets save_to_disk folder, or a Hugging Face dataset id (ORG/NAME[:SPLIT]) in the local cache"
)


def resolve_source(path: Path | str) -> Source:
    """The source ``path`` names, or a ``DataError`` naming it, what is wrong and what to pass instead."""
    from . import hub  # imports datasets only when a table is found

    text = str(path)
    path = Path(path)
    if any(c in text for c in "*?[") and not path.exists():
        return _glob_source(text)
    if path.is_file():
        kind = table_kind(path)
        if kind is not None:
            return hub.file_source(text, (path,), kind)
        return JsonArraySource(path) if is_json_array(path) else JsonlSource(path)
    if path.is_dir():
        return _folder_source(text, path)
    spec = hub_spec(text)
    if spec is not None:
        return hub.hub_source(text, spec)
    raise DataError(f"{text}: the data path does not exist. {ACCEPTED}")


def found_note(path: Path | str) -> str:
    """What the launch plan adds after the ``--data`` value: nothing when it is here (a path, or a glob that
    matches), a note for a Hub id (read from the cache when the run starts), else that it is not found."""
    if Path(path).exists() or glob.glob(str(path)):
        return ""
    return (
        "  (Hub dataset id: read from the local cache)"
        if hub_spec(str(path))
        else "  [not found on this machine]"
    )


def hub_spec(text: str) -> HubSpec | None:
    """``text`` as a Hub dataset id, or None when it reads as a local path (a data file ending, or a first
    part that exists here: a mistyped local path should say it does not exist, not search the cache)."""
    m = HUB_ID.match(text)
    if m is None or Path(m["repo"]).suffix in (*TABLE_SUFFIXES, ".jsonl", ".json"):
        return None
    if Path(text.split("/")[0]).exists():
        return None
    a, b = m["a"], m["b"]
    return HubSpec(m["repo"], a if b else None, b or a)


def table_kind(path: Path) -> str | None:
    """``PARQUET`` or ``ARROW`` for a table file (by its ending, else its first bytes), None for JSONL."""
    if path.suffix in TABLE_SUFFIXES:
        return TABLE_SUFFIXES[path.suffix]
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None  # the JSONL reader names the file and the fix
    return next((kind for magic, kind in _MAGIC if head.startswith(magic)), None)


def _glob_source(pattern: str) -> Source:
    from . import hub

    files = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
    if not files:
        raise DataError(f"{pattern}: the pattern matches no file. {ACCEPTED}")
    return hub.file_source(pattern, tuple(files), _one_kind(pattern, files))


def _folder_source(text: str, folder: Path) -> Source:
    from . import hub

    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return hub.disk_source(text, folder)
    files = sorted(p for p in folder.iterdir() if p.suffix in TABLE_SUFFIXES and p.is_file())
    if not files:
        raise DataError(
            f"{text}: the folder has no .parquet or .arrow files and is no datasets save_to_disk folder "
            f"(no state.json or dataset_dict.json). {ACCEPTED}"
        )
    return hub.file_source(text, tuple(files), _one_kind(text, files))


def _one_kind(label: str, files: list[Path]) -> str:
    kinds = {table_kind(f) for f in files}
    if None in kinds or len(kinds) > 1:
        names = ", ".join(sorted({f.suffix or f.name for f in files}))
        raise DataError(
            f"{label}: the shards are not all parquet or all arrow files ({names}). Point --data at one "
            "kind, e.g. a glob such as DIR/*.parquet"
        )
    return kinds.pop()  # type: ignore[return-value]
