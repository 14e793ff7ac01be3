"""Read the data (a JSONL file, a JSON array file or a table, ``sources.py``) into tokenized samples: in-process or in a
worker pool, now or in the background.

``load_samples`` tokenizes the data and returns when it is done; ``DataFuture`` runs the same load in a
background thread, so a launch can place the target on its devices while the data tokenizes. Big files
are cut into pieces of lines (JSON arrays and tables: batches of records, read a few at a time) that worker processes tokenize
in parallel (``pool.py``); pieces are merged in file order, so sample ids, counts and errors do not depend
on how the data was tokenized.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipe.cpus import usable_cpus
from dflash_pipe.diskspace import DiskFullError

from .arrays import ArrayRecords, tokenize_records
from .config import DataConfig
from .lines import Piece, Tokenized, tokenize_piece
from .pool import (
    MAX_PIECE_BYTES,
    piece_bytes,
    split_lines,
    tokenized_batches,
    tokenized_pieces,
    tokenized_records,
    worker_pool,
)
from .resolved import JsonArraySource, Source, TableSource
from .rows import tokenize_rows
from .samples import DROPS_NOT_SHORT, DataError, LoadedData, Sample
from .sources import resolve_source
from .store import StoreWriter, open_store, store_key
from .tables import record_batches

AUTO_PROGRESS_BYTES = 4 << 20
"""With ``progress=None``, files at least this big show a progress bar (when stderr is a terminal)."""
AUTO_PROGRESS_ROWS = 20_000
"""The same for tables, in rows."""
POOL_MIN_BYTES = 4 << 20
"""Smaller files are tokenized in-process: starting worker processes (each imports transformers and receives
the tokenizer, 1-2 s) costs more than the pool saves on them."""
MAX_AUTO_WORKERS = 16
"""``tokenize_workers=None`` uses one worker per CPU core but one, at most this many."""


def load_samples(
    cfg: DataConfig, tokenizer: Any, *, progress: bool | None = None, store: Path | None = None
) -> LoadedData:
    """Load ``cfg.path`` (any source ``resolve_source`` accepts); sample ids are 0..N-1 in file (row) order
    over the samples kept.

    Bad lines raise ``DataError("FILE:LINE: reason. fix")`` (tables: ``FILE:ROW``, the row's index), or with ``cfg.skip_bad_lines`` are skipped and
    counted per reason. Samples longer than ``cfg.max_length`` are truncated; samples with fewer than
    ``cfg.min_loss_tokens`` trainable anchor positions (p with loss_mask[p] and loss_mask[p+1]) are dropped.
    ``tokenizer`` (an HF fast tokenizer) is needed for conversation lines and bounds pre-tokenized ids by
    ``len(tokenizer)``; it may be None for pre-tokenized data. Files of at least ``POOL_MIN_BYTES`` are
    tokenized by ``tokenize_workers(cfg, size)`` worker processes (the result is the same). ``progress``:
    show a rich progress bar (None: when stderr is a terminal and the file is large). ``store``: a folder
    to keep the samples in on disk (``store.py``; a run's ``RUN_DIR/samples``), memory-mapped instead of
    held as tensors, and reused as they are when the data, settings and tokenizer have not changed.
    """
    return _load(cfg, tokenizer, progress, threading.Event(), store)


def tokenize_workers(cfg: DataConfig, size: int) -> int:
    """Worker processes for a file of ``size`` bytes; 0: tokenize in-process."""
    workers = cfg.tokenize_workers if cfg.tokenize_workers is not None else auto_workers()
    return workers if workers >= 2 and size >= POOL_MIN_BYTES else 0


def auto_workers() -> int:
    """``tokenize_workers=None``: one per CPU core this process may use but one (the launcher's own thread
    loads the target meanwhile), at most ``MAX_AUTO_WORKERS``."""
    return min(MAX_AUTO_WORKERS, usable_cpus() - 1)


class DataFuture:
    """``load_samples`` running in a background thread (with its worker processes, if any).

    ``result()`` waits and returns the ``LoadedData`` or raises what loading raised (the same ``DataError``).
    ``close()`` stops a load still running (the pool shut down, its processes ended) and waits for the
    thread; it is safe to call twice and after ``result()``. Use it as a context manager.
    """

    def __init__(
        self, cfg: DataConfig, tokenizer: Any, *, progress: bool | None = None, store: Path | None = None
    ) -> None:
        self.path = cfg.path
        self._cancel = threading.Event()
        self._outcome: LoadedData | BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(cfg, tokenizer, progress, store), name="dflash-tokenize", daemon=True
        )
        self._thread.start()

    def _run(self, cfg: DataConfig, tokenizer: Any, progress: bool | None, store: Path | None) -> None:
        try:
            self._outcome = _load(cfg, tokenizer, progress, self._cancel, store)
        except BaseException as e:  # handed to the thread that calls result()
            self._outcome = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> LoadedData:
        self._thread.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def close(self) -> None:
        self._cancel.set()
        self._thread.join()

    def __enter__(self) -> DataFuture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load(
    cfg: DataConfig, tokenizer: Any, progress: bool | None, cancel: threading.Event, store: Path | None
) -> LoadedData:
    source = resolve_source(cfg.path)
    if store is None:
        return _tokenize(source, cfg, tokenizer, progress, cancel, _ListSink())
    key = store_key(source, cfg, tokenizer)
    reused = open_store(store, key)
    if reused is not None:
        return reused
    with StoreWriter(store, key, label=source.label, tokenizer=tokenizer) as writer:
        return _tokenize(source, cfg, tokenizer, progress, cancel, writer)


def _tokenize(
    source: Source,
    cfg: DataConfig,
    tokenizer: Any,
    progress: bool | None,
    cancel: threading.Event,
    sink: Sink,
) -> LoadedData:
    if isinstance(source, TableSource):
        return _load_table(source, cfg, tokenizer, progress, cancel, sink)
    if isinstance(source, JsonArraySource):
        return _load_array(source, cfg, tokenizer, progress, cancel, sink)
    path = source.path
    try:
        size = path.stat().st_size
        workers = tokenize_workers(cfg, size)
        with _progress_bar(path, size, progress) as advance:
            if not workers:  # in pieces too, so a big file's samples reach the store a piece at a time
                pieces = (
                    tokenize_piece(path, piece, cfg, tokenizer, advance=advance, cancel=cancel)
                    for piece in split_lines(path, MAX_PIECE_BYTES)
                )
                return _merge(path, cfg, pieces, sink)
            target = piece_bytes(size, workers)
            with worker_pool(path, cfg, tokenizer, min(workers, math.ceil(size / target))) as pool:
                done = _advancing(tokenized_pieces(pool, path, target, cancel), advance)
                return _merge(path, cfg, done, sink)
    except DiskFullError:
        raise  # the store's disk, already named
    except OSError as e:
        raise DataError(
            f"{path}: cannot read the data file ({e.strerror or e}). Check its permissions"
        ) from None


def _load_table(
    source: TableSource,
    cfg: DataConfig,
    tokenizer: Any,
    progress: bool | None,
    cancel: threading.Event,
    sink: Sink,
) -> LoadedData:
    """A table, batch by batch: in-process, or by worker processes fed a few batches ahead (``pool.py``)."""
    label = source.label
    workers = tokenize_workers(cfg, source.size)
    batches = record_batches(source)
    with _progress_bar(label, source.rows, progress, unit="rows") as advance:
        if not workers:
            done = (
                (b.num_rows, tokenize_rows(label, first, b, cfg, tokenizer, cancel=cancel))
                for first, b in batches
            )
            return _merge(label, cfg, _advancing(done, advance), sink)
        with worker_pool(label, cfg, tokenizer, workers) as pool:
            done = _advancing(tokenized_batches(pool, label, batches, cancel, workers), advance)
            return _merge(label, cfg, done, sink)


def _load_array(
    source: JsonArraySource,
    cfg: DataConfig,
    tokenizer: Any,
    progress: bool | None,
    cancel: threading.Event,
    sink: Sink,
) -> LoadedData:
    """A JSON array file, record batch by record batch (``arrays.py``), like a table: in-process, or by
    worker processes fed a few batches ahead. A file cut short adds its note to the data's notes."""
    path, label = source.path, source.label
    try:
        size = path.stat().st_size
        workers = tokenize_workers(cfg, size)
        records = ArrayRecords(path, label)
        notes = lambda: [records.note] if records.note else []  # noqa: E731 -- read once all is merged
        with _progress_bar(path, size, progress) as advance:
            if not workers:
                done = (
                    (n, tokenize_records(label, first, batch, cfg, tokenizer, cancel=cancel))
                    for first, n, batch in records.batches()
                )
                return _merge(label, cfg, _advancing(done, advance), sink, notes)
            with worker_pool(path, cfg, tokenizer, workers) as pool:
                done = tokenized_records(pool, label, records.batches(), cancel, workers)
                return _merge(label, cfg, _advancing(done, advance), sink, notes)
    except DiskFullError:
        raise
    except OSError as e:
        raise DataError(
            f"{path}: cannot read the data file ({e.strerror or e}). Check its permissions"
        ) from None


def _advancing(
    pieces: Iterable[tuple[Piece | int, Tokenized]], advance: Callable[[int], None]
) -> Iterator[Tokenized]:
    """The tokenized pieces, advancing the bar by each one's bytes (a ``Piece``) or rows (an int)."""
    for piece, done in pieces:
        advance(piece if isinstance(piece, int) else piece.end - piece.start)
        yield done


class _ListSink:
    """The samples as a list of tensors in memory (``load_samples`` without a store)."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    @property
    def count(self) -> int:
        return len(self.samples)

    def add(self, samples: list[tuple[np.ndarray, np.ndarray]]) -> None:
        import torch  # here, not at the top: the tokenization workers import this package without torch

        for ids, mask in samples:
            self.samples.append(
                Sample(
                    sample_id=len(self.samples),
                    input_ids=torch.from_numpy(ids),  # [S] int64
                    loss_mask=torch.from_numpy(mask),  # [S] bool
                )
            )

    def commit(self, left_out: dict[str, Any]) -> list[Sample]:
        return self.samples


Sink = _ListSink | StoreWriter
"""Where merged samples go: a list in memory or a store on disk (``store.py``)."""


def _merge(
    path: Path | str,
    cfg: DataConfig,
    pieces: Iterable[Tokenized],
    sink: Sink,
    notes: Callable[[], list[str]] = list,
) -> LoadedData:
    """Tokenized pieces, in file order, to one dataset with dense sample ids (in ``sink``); ``notes()``
    (asked once every piece is merged: how the file was read) go into the data's notes."""
    reasons: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    truncated = 0
    shortest_cut: int | None = None
    for part in pieces:
        sink.add(part.samples)
        reasons.update(part.reasons)
        dropped.update(part.dropped)
        truncated += part.truncated
        if part.shortest_cut is not None:
            shortest_cut = min(part.shortest_cut, shortest_cut or part.shortest_cut)
    skipped = sum(reasons.values())
    dropped_short = sum(n for why, n in dropped.items() if why not in DROPS_NOT_SHORT)
    read_notes = notes()
    if not sink.count:
        if shortest_cut is not None:
            raise DataError(no_fit_message(path, cfg, shortest_cut, need=shortest_cut, what="sample"))
        left_out = ", ".join(f"{n} {why}" for why, n in sorted(dropped.items())) or "none"
        raise DataError(
            f"{path}: no usable samples ({skipped} bad lines skipped; samples left out: {left_out}; a sample "
            f"needs min_loss_tokens={cfg.min_loss_tokens} trainable positions). Check that the file has "
            "conversations with assistant replies (or pre-tokenized lines with a non-zero loss_mask)"
            + "".join(f" ({note})" for note in read_notes)
        )
    counts: dict[str, Any] = {
        "skipped_lines": skipped,
        "truncated": truncated,
        "dropped_short": dropped_short,
        "skip_reasons": dict(reasons),
        "drop_reasons": dict(dropped),
        "notes": read_notes,
    }
    return LoadedData(samples=sink.commit(counts), **counts)


def no_fit_message(path: Path | str, cfg: DataConfig, shortest: int, *, need: int, what: str) -> str:
    """One line for a file none of whose samples fits ``max_length``: the shortest ``what``, and ``need``,
    the length that would fit it."""
    return (
        f"no sample of {path} fits --max-length {cfg.max_length}: the shortest {what} is {shortest} tokens; "
        f"raise --max-length (data.max_length) to at least {need}"
    )


@contextmanager
def _progress_bar(
    path: Path | str, total: int | None, show: bool | None, *, unit: str = "bytes"
) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)`` (bytes, or rows of a table, whose total may be unknown); draws a rich bar on
    stderr when asked (or automatically for big files and tables of ``AUTO_PROGRESS_ROWS`` rows)."""
    if show is None:
        big = AUTO_PROGRESS_BYTES if unit == "bytes" else AUTO_PROGRESS_ROWS
        show = (total is None or total >= big) and sys.stderr.isatty()
    if not show:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    columns = (TextColumn("loading {task.description}"), BarColumn(), count, TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(Path(path).name if unit == "bytes" else str(path), total=total)
        pending = 0

        def advance(n: int) -> None:
            nonlocal pending
            pending += n
            if pending >= 1 << 16:  # update in 64 KiB steps: refreshing per line costs more than parsing
                bar.advance(task, pending)
                pending = 0

        yield advance
        bar.advance(task, pending)
