"""Tokenize a big data file in worker processes: pieces of lines in, tokenized pieces out, in file order.
Tables go the same way, their record batches as the pieces (``tokenized_batches``), and so do JSON array
files, batches of their records read by the parent (``tokenized_records``).

The file is cut into byte ranges that end at line ends (``split_lines``; the parent counts the newlines, so
each piece knows its first line number). Worker processes (spawn context: no forked torch or tokenizer
state) each receive the tokenizer once, pickled over the pipe to their own parent only (docs/security.md),
and run ``tokenize_piece`` on the pieces they are given; ``tokenized_pieces`` yields the results in file
order, so the merged samples, counts and the first bad line's error are exactly those of an in-process pass. Workers ignore SIGINT: a Ctrl-C reaches the launcher,
which shuts the pool down. A worker that dies (killed, out of memory) is a ``DataError``, never a hang.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .config import DataConfig
from .lines import LoadCancelled, Piece, Tokenized, tokenize_piece
from .samples import DataError
from .tables import from_bytes, to_bytes

MIN_PIECE_BYTES = 64 << 10
MAX_PIECE_BYTES = 1 << 20
"""A piece is small enough that stopping the pool (which lets started pieces finish) is quick."""
PIECES_PER_WORKER = 8
BATCHES_AHEAD = 4
"""Record batches per worker read ahead of the one the merge waits for: a table's rows are in the parent's
memory until tokenized, so only this many are (a JSONL piece is only a byte range)."""
"""Enough pieces per worker that uneven lines still keep every worker busy to the end."""
_POLL_S = 0.1

_worker: dict[str, Any] = {}


def piece_bytes(size: int, workers: int) -> int:
    """The piece size for a file of ``size`` bytes over ``workers`` processes."""
    return min(MAX_PIECE_BYTES, max(MIN_PIECE_BYTES, size // max(1, workers * PIECES_PER_WORKER)))


def split_lines(path: Path, target_bytes: int) -> Iterator[Piece]:
    """Consecutive pieces of about ``target_bytes`` each, cut after a newline, covering the whole file."""
    with open(path, "rb") as f:
        start, line = 0, 1
        while chunk := f.read(target_bytes):
            if not chunk.endswith(b"\n"):
                chunk += f.readline()  # to the end of the line (or of the file)
            yield Piece(start, start + len(chunk), line)
            start += len(chunk)
            line += chunk.count(b"\n")


@contextmanager
def worker_pool(path: Path, cfg: DataConfig, tokenizer: Any, workers: int) -> Iterator[ProcessPoolExecutor]:
    """``workers`` spawned processes holding ``tokenizer``; on exit, queued pieces are cancelled and the
    processes end (started pieces finish first: each is at most ``MAX_PIECE_BYTES``)."""
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(str(path), cfg, tokenizer),
    )
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def tokenized_pieces(
    pool: ProcessPoolExecutor, path: Path, target_bytes: int, cancel: threading.Event
) -> Iterator[tuple[Piece, Tokenized]]:
    """Every piece of ``path`` tokenized by ``pool``, in file order. A piece's ``DataError`` is raised when
    its turn comes (so the first bad line of the file is the one reported)."""
    submitted: deque[tuple[Piece, Future]] = deque()
    for piece in split_lines(path, target_bytes):  # the workers start on the first pieces meanwhile
        _check_cancel(cancel, path)
        submitted.append((piece, pool.submit(_tokenize_in_worker, piece)))
    while submitted:  # popped, so a merged piece's samples are not held here until the end
        piece, future = submitted.popleft()
        yield piece, _result(future, cancel, path)


def tokenized_batches(
    pool: ProcessPoolExecutor,
    label: str,
    batches: Iterable[tuple[int, Any]],
    cancel: threading.Event,
    workers: int,
) -> Iterator[tuple[int, Tokenized]]:
    """Every ``(first_row, record batch)`` of a table tokenized by ``pool``, in order, as ``(rows,
    Tokenized)``; at most ``workers * BATCHES_AHEAD`` batches are read and not yet merged."""
    jobs = ((b.num_rows, _tokenize_rows_in_worker, (first, to_bytes(b))) for first, b in batches)
    return _in_order(pool, label, jobs, cancel, workers)


def tokenized_records(
    pool: ProcessPoolExecutor,
    label: str,
    batches: Iterable[tuple[int, int, list[Any]]],
    cancel: threading.Event,
    workers: int,
) -> Iterator[tuple[int, Tokenized]]:
    """Every ``(first index, bytes, records)`` batch of a JSON array (``arrays.ArrayRecords.batches``)
    tokenized by ``pool``, in order, as ``(bytes, Tokenized)``; read ahead as ``tokenized_batches`` does."""
    jobs = ((n, _tokenize_records_in_worker, (first, records)) for first, n, records in batches)
    return _in_order(pool, label, jobs, cancel, workers)


def _in_order(
    pool: ProcessPoolExecutor,
    label: str,
    jobs: Iterable[tuple[int, Callable[..., Tokenized], tuple[Any, ...]]],
    cancel: threading.Event,
    workers: int,
) -> Iterator[tuple[int, Tokenized]]:
    """``(amount, worker function, its args)`` jobs run by ``pool``, yielded in order as ``(amount,
    Tokenized)``, at most ``workers * BATCHES_AHEAD`` submitted and not yet merged."""
    pending: deque[tuple[int, Future]] = deque()
    for amount, fn, args in jobs:
        _check_cancel(cancel, label)
        pending.append((amount, pool.submit(fn, *args)))
        if len(pending) >= workers * BATCHES_AHEAD:
            n, future = pending.popleft()
            yield n, _result(future, cancel, label)
    while pending:
        n, future = pending.popleft()
        yield n, _result(future, cancel, label)


def _result(future: Future, cancel: threading.Event, path: Path | str) -> Tokenized:
    """A piece's result once done (``cancel`` checked meanwhile); a dead worker is a ``DataError``."""
    while not wait([future], timeout=_POLL_S, return_when=FIRST_COMPLETED).done:
        _check_cancel(cancel, path)
    try:
        return future.result()
    except BrokenProcessPool as e:
        raise DataError(
            f"{path}: a tokenization worker process died ({e}). Tokenize in-process with "
            "--tokenize-workers 1, or use fewer workers if the machine ran out of memory"
        ) from None


def _check_cancel(cancel: threading.Event, path: Path | str) -> None:
    if cancel.is_set():
        raise LoadCancelled(f"{path}: loading stopped: the run stopped waiting for it")


def _init_worker(path: str, cfg: DataConfig, tokenizer: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and stops the pool
    _worker.update(path=Path(path), label=path, cfg=cfg, tokenizer=tokenizer)


def _tokenize_in_worker(piece: Piece) -> Tokenized:
    return tokenize_piece(_worker["path"], piece, _worker["cfg"], _worker["tokenizer"])


def _tokenize_records_in_worker(first: int, records: list[Any]) -> Tokenized:
    from .arrays import tokenize_records

    return tokenize_records(_worker["label"], first, records, _worker["cfg"], _worker["tokenizer"])


def _tokenize_rows_in_worker(first_row: int, batch: bytes) -> Tokenized:
    from .rows import tokenize_rows

    return tokenize_rows(_worker["label"], first_row, from_bytes(batch), _worker["cfg"], _worker["tokenizer"])
