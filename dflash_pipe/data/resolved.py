"""What a ``--data`` value resolved to (``sources.resolve_source`` decides): a JSONL file, a JSON array file,
or the files of a table, and a Hub dataset id as written. Apart from the resolving so that the table readers (``hub``,
``tables``) and the resolver can both name these types without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PARQUET, ARROW = "parquet", "arrow"


@dataclass(frozen=True, slots=True)
class JsonlSource:
    """One JSONL file: one conversation or pre-tokenized sample per line."""

    path: Path

    @property
    def label(self) -> str:
        return str(self.path)


@dataclass(frozen=True, slots=True)
class JsonArraySource:
    """One file holding one JSON array of records (``arrays.py``): record ``N`` is read as line ``N + 1``
    of a JSONL file would be, and named ``FILE:[N]``."""

    path: Path

    @property
    def label(self) -> str:
        return str(self.path)


@dataclass(frozen=True, slots=True)
class TableSource:
    """Rows of one or more parquet or arrow files, in this order: row ``i`` of the dataset is sample
    candidate ``i`` (what ``FILE:ROW`` errors and regeneration's indexes count)."""

    label: str
    """The ``--data`` value as the user wrote it: what every error names."""
    files: tuple[Path, ...]
    kind: str
    """``PARQUET`` or ``ARROW`` (IPC file or stream format; told apart when a file is opened)."""
    rows: int | None = None
    """Rows in all, where known without reading the files (progress bars)."""
    what: str = ""
    """How the data was found, for the launch summary (e.g. ``Hub dataset ... from the cache ...``)."""

    @property
    def size(self) -> int:
        """Bytes of the files (what decides whether worker processes tokenize it)."""
        return sum(f.stat().st_size for f in self.files)


Source = JsonlSource | JsonArraySource | TableSource


@dataclass(frozen=True, slots=True)
class HubSpec:
    """A Hub dataset id as ``--data`` wrote it."""

    repo_id: str
    config: str | None
    split: str | None
