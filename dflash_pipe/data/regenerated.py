"""Regenerated conversations on disk: the source conversations in, one JSONL file of the target's replies out.

The file (``RUN_DIR/regenerated.jsonl`` in a run, ``--out`` for ``dflash-pipe regenerate``) is in the
messages format, so it trains as ``--data FILE --responses dataset``. Its first line is the provenance
header ``{"dflash_pipe": {"regenerated": {...}}}`` (target, settings, source data); each later line is one
conversation, keyed by its index in the source (the order of its conversations, bad lines or rows skipped;
``conversations.py`` reads them):

- ``{"messages": [...], "regen": {"index": 3, "turns": 2, "truncated": 0, "capped": 0, "looped": 0,
  "new_tokens": 118, "failed": null, "tokens": {"ids": [...], "trained": [[41, 97], ...]}}}``
  (``capped``, ``looped``, ``tokens``: see ``Regenerated``; absent in files written before they were kept)
- ``{"dflash_pipe": {"index": 7, "failed": {...}}}`` when not one turn could be generated (every reader
  skips it, see ``formats.is_bookkeeping``).

A conversation is appended once all its turns are generated, and flushed with its job, so a process killed
mid-regeneration loses only the job in progress: reopening the file keeps every complete line, cuts a torn
last line and reports which indexes are done. A file whose header differs from this run's target or settings
is refused (not silently mixed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipe.diskspace import is_no_space, no_space_error

from .config import DataConfig, RegenConfig
from .formats import BOOKKEEPING_KEY
from .resolved import Source, TableSource
from .samples import DataError
from .sources import resolve_source
from .token_form import TokenForm

FILE_VERSION = 1


@dataclass(slots=True)
class TurnFailure:
    """The first assistant turn that could not be generated; it and the turns after it are left out."""

    turn: int
    """Index of the assistant turn (0 = the first assistant reply)."""
    reason: str
    """``prompt too long`` (no room left under data.max_length), ``empty reply`` (the target ended the turn
    at once), ``template error`` (the chat template refused the conversation), ``sample full`` (an
    earlier reply filled data.max_length, so training would cut this turn off) or ``looped`` (the reply
    ended in a loop and ``regen.loops`` is "drop")."""
    skipped_turns: int
    """Assistant turns not generated because of it (this one and every later one)."""


@dataclass(slots=True)
class Regenerated:
    """One conversation as the target answered it."""

    index: int
    """The conversation's index in the source file (over the conversations kept)."""
    messages: list[dict[str, str]]
    """The conversation up to its last generated assistant turn (empty when none could be generated)."""
    turns: int = 0
    """Assistant turns generated."""
    truncated: int = 0
    """Turns cut at the token limit (max_new_tokens, or the room left under data.max_length)."""
    capped: int = 0
    """Of those, turns that ran to ``regen.max_new_tokens`` itself (the cap, not the room left)."""
    looped: int = 0
    """Replies that ended in a loop (``data.loops``), kept or, with ``regen.loops`` "drop", dropped."""
    new_tokens: int = 0
    """Tokens the target generated for this conversation."""
    failed: TurnFailure | None = None
    tokens: TokenForm | None = None
    """The ids the target read and wrote, which its sample trains (None: rendered from ``messages``)."""

    def to_line(self) -> dict[str, Any]:
        failed = None if self.failed is None else _failure_dict(self.failed)
        if not self.turns:
            return {BOOKKEEPING_KEY: {"index": self.index, "failed": failed}}
        regen = {
            "index": self.index,
            "turns": self.turns,
            "truncated": self.truncated,
            "capped": self.capped,
            "looped": self.looped,
            "new_tokens": self.new_tokens,
            "failed": failed,
        }
        if self.tokens is not None:
            regen["tokens"] = self.tokens.to_json()
        return {"messages": self.messages, "regen": regen}

    @classmethod
    def from_line(cls, obj: dict[str, Any]) -> Regenerated:
        info = obj.get("regen") if "messages" in obj else obj.get(BOOKKEEPING_KEY)
        if not isinstance(info, dict) or not isinstance(info.get("index"), int):
            raise ValueError("not a regenerated conversation (no regen index)")
        failed = info.get("failed")
        return cls(
            index=info["index"],
            messages=list(obj.get("messages", [])),
            turns=int(info.get("turns", 0)),
            truncated=int(info.get("truncated", 0)),
            capped=int(info.get("capped", 0)),
            looped=int(info.get("looped", 0)),
            new_tokens=int(info.get("new_tokens", 0)),
            failed=TurnFailure(**failed) if isinstance(failed, dict) else None,
            tokens=TokenForm.from_json(info.get("tokens")),
        )


def _failure_dict(f: TurnFailure) -> dict[str, Any]:
    return {"turn": f.turn, "reason": f.reason, "skipped_turns": f.skipped_turns}


def file_digest(path: Path) -> dict[str, Any]:
    """Size and sha256 of a file (the source data, the target's config): what provenance compares."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"path": str(Path(path).resolve()), "bytes": Path(path).stat().st_size, "sha256": h.hexdigest()}


def source_digest(source: Source) -> dict[str, Any]:
    """What provenance records of the data: a JSONL file's ``file_digest`` (as before tables were read), or
    a table's files (names and sizes) and one sha256 over their contents in order."""
    if not isinstance(source, TableSource):
        return file_digest(source.path)
    h = hashlib.sha256()
    for path in source.files:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    files = [[p.name, p.stat().st_size] for p in source.files]
    return {"path": source.label, "files": files, "sha256": h.hexdigest()}


def target_identity(target_path: Path) -> dict[str, Any]:
    """What names a target for provenance: its config's digest and its weight files' names and sizes
    (hashing the weights of a 27B target would take minutes)."""
    target_path = Path(target_path)
    weights = sorted(
        (p.name, p.stat().st_size)
        for p in target_path.iterdir()
        if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file()
    )
    out = {"path": str(target_path.resolve()), "weights": weights}
    for name in ("config.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (target_path / name).is_file():  # the chat template and end-of-turn ids live in these
            out[name] = file_digest(target_path / name)["sha256"]
    return out


def provenance(target_path: Path, data: DataConfig, settings: RegenConfig) -> dict[str, Any]:
    """Where a regenerated file comes from: the target, the generation settings, the source data."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tool = version("dflash-pipe")
    except PackageNotFoundError:
        tool = "unknown"
    out = {
        "target": target_identity(target_path),
        "settings": {
            **settings.provenance(),
            "max_length": data.max_length,
            "chat_template_kwargs": data.chat_template_kwargs,
        },
        "source": source_digest(resolve_source(data.path)),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dflash_pipe": tool,
    }
    return json.loads(json.dumps(out))  # as it reads back from the file (tuples become lists)


COMPARED = ("target", "settings", "source")
"""Provenance keys that must match for a file to be reused (not the creation time or tool version; paths
are not compared, contents are)."""


class RegenFileError(DataError):
    """A regenerated file that cannot be reused: damaged, or made from another target, source or settings."""


class RegenStore:
    """The regenerated file, open for appending; ``done`` holds every conversation already in it."""

    def __init__(self, path: Path, provenance: dict[str, Any]) -> None:
        """Opens (or creates) ``path``. An existing file must carry the same provenance under ``COMPARED``
        (else ``RegenFileError`` naming the difference); a torn last line (a kill mid-write) is cut off."""
        self.path = Path(path)
        self.provenance = provenance
        self.done = DoneRecords(self.path)
        """Every conversation in the file, read back by index on demand (not held in memory)."""
        self.torn_bytes = 0
        """Bytes of a torn last line cut off when the file was opened."""
        if self.path.exists() and self.path.stat().st_size > 0:
            self._read_existing()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write_header()
        self._file = open(self.path, "ab")  # noqa: SIM115 -- closed by close()
        self._size = self.path.stat().st_size
        self.done.open()

    def _write_header(self) -> None:
        header = {BOOKKEEPING_KEY: {"regenerated": {"version": FILE_VERSION, **self.provenance}}}
        self.path.write_text(json.dumps(header) + "\n")

    def _read_existing(self) -> None:
        """The header checked, then every complete line's index and byte range (a line at a time: the
        file may be bigger than memory); a torn last line is cut off."""
        with open(self.path, "rb") as f:
            first = f.readline()
            if not first.endswith(b"\n"):  # killed while writing the header: nothing was generated yet
                self._write_header()
                return
            self._check_header(first)
            start, n = len(first), 1
            for line in f:
                n += 1
                if not line.endswith(b"\n"):  # no newline at the end: the write of that line was cut short
                    self.torn_bytes = len(line)
                    break
                if line.strip():
                    try:
                        record = Regenerated.from_line(json.loads(line))
                    except (ValueError, TypeError, KeyError) as e:
                        raise RegenFileError(
                            f"{self.path}:{n}: damaged line ({e}). Delete the file to regenerate everything, "
                            "or cut the lines from this one on to keep the rest"
                        ) from None
                    self.done.add(record.index, start, len(line))
                start += len(line)
        if self.torn_bytes:
            with open(self.path, "r+b") as f:
                f.truncate(start)

    def _check_header(self, first: bytes) -> None:
        try:
            header = json.loads(first)[BOOKKEEPING_KEY]["regenerated"]
        except (IndexError, ValueError, KeyError, TypeError):
            raise RegenFileError(
                f"{self.path}: not a regenerated-conversations file (its first line is not the dflash-pipe "
                "provenance header). Move it away, or point the run at a new run dir"
            ) from None
        for key in COMPARED:
            old, new = _content(header.get(key)), _content(self.provenance.get(key))
            if old != new:
                raise RegenFileError(
                    f"{self.path}: made with another {key} ({_diff(old, new)}); "
                    "its conversations are not what this run's target and settings would say. Delete the file "
                    "(it is regenerated), or run with the settings it was made with"
                )

    def append(self, records: Iterable[Regenerated]) -> None:
        """Writes the records and flushes them to disk (one job's worth at a time). A full disk is
        ``DiskFullError``; what was written before stays, a torn last line is cut off when the file reopens."""
        records = list(records)
        lines = [(json.dumps(r.to_line(), ensure_ascii=False) + "\n").encode() for r in records]
        try:
            for line in lines:
                self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            needed = sum(len(line) for line in lines)
            if is_no_space(exc, self.path, needed):
                raise no_space_error(
                    self.path,
                    needed,
                    what=f"{len(records)} regenerated conversation(s)",
                    fix="Free space there or move the run dir to a larger disk, then resume: what is in the "
                    "file stays and is not generated again",
                ) from None
            raise
        for record, line in zip(records, lines, strict=True):
            self.done.add(record.index, self._size, len(line))
            self._size += len(line)

    def close(self) -> None:
        self.done.close()
        if not self._file.closed:
            with contextlib.suppress(OSError):  # a full disk was already reported by append
                self._file.close()


class DoneRecords(Mapping[int, Regenerated]):
    """The conversations of a regenerated file by index: each one's byte range (16 bytes an index), the
    record parsed from the file when asked for, so a run over 10M conversations does not hold their
    replies in memory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._start = np.full(0, -1, dtype=np.int64)
        self._length = np.zeros(0, dtype=np.int64)
        self._count = 0
        self._fd: int | None = None

    def add(self, index: int, start: int, length: int) -> None:
        if index >= len(self._start):
            grow = max(index + 1, 2 * len(self._start), 1024)
            self._start = np.concatenate([self._start, np.full(grow - len(self._start), -1, dtype=np.int64)])
            self._length = np.concatenate([self._length, np.zeros(grow - len(self._length), dtype=np.int64)])
        self._count += int(self._start[index] < 0)
        self._start[index], self._length[index] = start, length

    def open(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and 0 <= index < len(self._start) and self._start[index] >= 0

    def __getitem__(self, index: int) -> Regenerated:
        if index not in self:
            raise KeyError(index)
        start, length = int(self._start[index]), int(self._length[index])
        if self._fd is not None:
            raw = os.pread(self._fd, length, start)
        else:
            with open(self.path, "rb") as f:
                f.seek(start)
                raw = f.read(length)
        return Regenerated.from_line(json.loads(raw))

    def __iter__(self) -> Iterator[int]:
        return (int(i) for i in np.flatnonzero(self._start >= 0))

    def __len__(self) -> int:
        return self._count


def _content(value: Any) -> Any:
    """A provenance entry without its path: a moved target or data file is still the same content."""
    return {k: v for k, v in value.items() if k != "path"} if isinstance(value, dict) else value


def _diff(old: Any, new: Any) -> str:
    """The first differing field of two provenance values, as ``key: file value != this run's``."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return f"{key}: file has {old.get(key)!r}, this run {new.get(key)!r}"
    return f"file has {old!r}, this run {new!r}"


@dataclass(slots=True)
class RegenTally:
    """What regeneration has done so far: shown on the dashboard, logged, and in the run's summary."""

    conversations: int = 0
    turns: int = 0
    truncated_turns: int = 0
    capped_turns: int = 0
    """Replies that ran to ``regen.max_new_tokens``."""
    looped_turns: int = 0
    """Replies that ended in a loop (``data.loops``), kept or dropped."""
    new_tokens: int = 0
    dropped: int = 0
    """Conversations with no generated turn (nothing written but their bookkeeping line)."""
    failed: Counter[str] = field(default_factory=Counter)
    """Failed turns (the first failing one of each conversation) by reason."""
    skipped_turns: int = 0
    """Turns not generated: each failed turn and the turns after it."""
    rendered: int = 0
    """Conversations with turns but no ``tokens``: their sample is rendered from the text."""

    def add(self, record: Regenerated) -> None:
        self.conversations += 1
        self.turns += record.turns
        self.truncated_turns += record.truncated
        self.capped_turns += record.capped
        self.looped_turns += record.looped
        self.new_tokens += record.new_tokens
        self.dropped += int(not record.turns)
        self.rendered += int(record.turns > 0 and record.tokens is None)
        if record.failed is not None:
            self.failed[record.failed.reason] += 1
            self.skipped_turns += record.failed.skipped_turns

    def failed_text(self) -> str:
        return ", ".join(f"{n} {why}" for why, n in sorted(self.failed.items())) or "none"
