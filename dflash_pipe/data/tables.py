"""Rows of parquet and arrow files in record batches of a bounded size: the way tables are read, so memory
holds a few batches, never the whole dataset.

Only the columns a sample can come from are read (``COLUMNS``): a wide dataset's other columns (ids,
sources, long metadata) cost nothing. Parquet is read by ``ParquetFile.iter_batches`` without pre-buffering
(which would read ahead the column chunks of every row group: memory that grows with the file); arrow files (IPC
stream, as ``datasets`` writes them, or IPC file) through a plain file, not a memory map, so the pages read
are freed with their batch instead of staying in the process's resident set.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .formats import BOOKKEEPING_KEY
from .resolved import PARQUET, TableSource
from .samples import DataError

COLUMNS = ("messages", "conversations", "input_ids", "loss_mask", BOOKKEEPING_KEY)
"""Top-level keys ``formats.parse_record`` reads: the only columns read from a table."""
BATCH_ROWS = 256
"""Rows per batch: a worker's piece of work, and the unit the reader holds in memory."""


def record_batches(source: TableSource, batch_rows: int = BATCH_ROWS) -> Iterator[tuple[int, Any]]:
    """``(first_row, pyarrow.RecordBatch)`` over every file of ``source`` in order, at most ``batch_rows``
    rows each; ``first_row`` is the dataset row index of the batch's first row."""
    first = 0
    for path in source.files:
        for batch in _file_batches(source, path, batch_rows):
            for start in range(0, batch.num_rows, batch_rows):
                piece = batch.slice(start, batch_rows)
                yield first, piece
                first += piece.num_rows


def rows(batch: Any) -> list[dict[str, Any]]:
    """A batch's rows as dicts, without null fields: a table that mixes formats has every column in every
    row (null where a row has none), which a JSONL line would simply not have."""
    return [{k: v for k, v in row.items() if v is not None} for row in batch.to_pylist()]


def table_rows(source: TableSource) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row index, row)`` over the whole dataset, batch by batch."""
    for first, batch in record_batches(source):
        yield from enumerate(rows(batch), start=first)


def _file_batches(source: TableSource, path: Path, batch_rows: int) -> Iterator[Any]:
    import pyarrow as pa

    try:
        if source.kind == PARQUET:
            yield from _parquet_batches(source, path, batch_rows)
        else:
            yield from _arrow_batches(source, path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{source.label}: cannot read {path} as {source.kind} ({exc}). Check that the file is complete "
            "and of that format"
        ) from None


def _parquet_batches(source: TableSource, path: Path, batch_rows: int) -> Iterator[Any]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path, pre_buffer=False) as f:  # pre-buffering reads ahead every row group
        columns = _columns(source, path, f.schema_arrow.names)
        yield from f.iter_batches(batch_size=batch_rows, columns=columns)


def _arrow_batches(source: TableSource, path: Path) -> Iterator[Any]:
    import pyarrow as pa

    with pa.OSFile(str(path)) as raw:  # a plain file: what a batch read is freed with it
        stream = raw.read(6) != b"ARROW1"
        raw.seek(0)
        reader = pa.ipc.open_stream(raw) if stream else pa.ipc.open_file(raw)
        columns = _columns(source, path, reader.schema.names)
        batches = reader if stream else (reader.get_batch(i) for i in range(reader.num_record_batches))
        for batch in batches:
            yield batch.select(columns)


def _columns(source: TableSource, path: Path, names: list[str]) -> list[str]:
    """The ``COLUMNS`` a file has; none: a ``DataError`` (every row would be a bad row)."""
    present = [c for c in COLUMNS if c in names]
    if not present:
        shown = ", ".join(names[:8]) or "none"
        raise DataError(
            f"{source.label}: {path.name} has no 'messages', 'conversations' or 'input_ids' column (columns: "
            f"{shown}). Use the messages, ShareGPT or pre-tokenized format (see dflash_pipe.data.formats)"
        )
    return present


def to_bytes(batch: Any) -> bytes:
    """A batch as an arrow IPC stream, for a worker process: only the batch's own rows (pickling a slice
    would send its parent's whole buffers)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def from_bytes(data: bytes) -> Any:
    """``to_bytes``'s batch back."""
    import pyarrow as pa

    return pa.ipc.open_stream(data).read_next_batch()
