"""Tokenized samples on disk: flat token ids, packed loss masks and offsets, memory-mapped, so a run holds
pages of the samples it trains on instead of every sample as its own pair of tensors (1M conversations
took 2 GiB in memory; 10M would take ~23 GB).

A store is a folder (``RUN_DIR/samples`` in a run): ``ids.bin`` (every kept sample's token ids, one after
the other; uint32, or int64 without a tokenizer: pre-tokenized ids are then unbounded), ``mask.bin`` (the
loss masks as one bit stream, ``np.packbits`` little-endian), ``offsets.bin`` (int64 [N+1]: sample ``i`` is
tokens ``offsets[i]:offsets[i+1]``) and ``meta.json`` (the key, the sizes, what the load left out). The key
is a digest of the source's files (path, size, mtime), the ``DataConfig`` fields that change samples and the
tokenizer, so a resumed run with the same data reuses the store and any change rebuilds it. A store is
written in ``samples.partial`` and renamed into place once complete: a load killed mid-write leaves no
store (only a partial folder, removed by the next build), and files whose sizes do not match ``meta.json``
are rebuilt too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from .config import DataConfig
from .resolved import JsonArraySource, JsonlSource, Source
from .samples import DataError, LoadedData, Sample

STORE_VERSION = 2
"""Bumped when the layout or what tokenization makes of a record changes: older stores are rebuilt."""
IDS, MASK, OFFSETS, META = "ids.bin", "mask.bin", "offsets.bin", "meta.json"
_ID_DTYPES = {"uint32": np.uint32, "int64": np.int64}


def store_key(source: Source, cfg: DataConfig, tokenizer: Any) -> str:
    """What the samples depend on, as one sha256: the source files' identity, the cutting settings and the
    tokenizer (its whole ``tokenizer.json``, chat template and size)."""
    files = [source.path] if isinstance(source, (JsonlSource, JsonArraySource)) else list(source.files)
    h = hashlib.sha256()
    parts: dict[str, Any] = {
        "version": STORE_VERSION,
        "files": [_file_identity(f) for f in files],
        "max_length": cfg.max_length,
        "min_loss_tokens": cfg.min_loss_tokens,
        "skip_bad_lines": cfg.skip_bad_lines,  # a store kept past bad lines must not hide them from a strict load
        "chat_template_kwargs": cfg.chat_template_kwargs,
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    h.update(_tokenizer_digest(tokenizer).encode())
    return h.hexdigest()


def _file_identity(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _tokenizer_digest(tokenizer: Any) -> str:
    if tokenizer is None:
        return "no tokenizer"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h = hashlib.sha256(backend.to_str().encode() if backend is not None else repr(type(tokenizer)).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(str(len(tokenizer)).encode())
    return h.hexdigest()


def open_store(root: Path, key: str) -> LoadedData | None:
    """The samples of the complete store at ``root`` built with ``key``; None when there is none, it was
    built from other data or settings, or its files are torn (then it is rebuilt)."""
    try:
        meta = json.loads((root / META).read_text())
        if meta.get("key") != key:
            return None
        return LoadedData(samples=StoredSamples(root), **meta["left_out"])
    except (OSError, ValueError, KeyError, TypeError):  # torn: no meta, sizes off, fields missing
        return None


class StoreWriter:
    """Builds a store piece by piece (memory: one piece); ``commit`` moves it into place. Leaving the
    ``with`` block without a commit (an error, a cancelled load) removes the partial folder."""

    def __init__(self, root: Path, key: str, *, label: str, tokenizer: Any) -> None:
        self.root, self.key, self.label = Path(root), key, label
        self.dtype = "uint32" if tokenizer is not None else "int64"
        self._vocab = tokenizer
        self._partial = self.root.with_name(self.root.name + ".partial")
        shutil.rmtree(self._partial, ignore_errors=True)  # what a killed build left
        try:
            self._partial.mkdir(parents=True)
            # open for the writer's life: closed by commit() or on leaving the with block
            self._ids = open(self._partial / IDS, "wb")  # noqa: SIM115
            self._mask = open(self._partial / MASK, "wb")  # noqa: SIM115
            self._offsets = open(self._partial / OFFSETS, "wb")  # noqa: SIM115
            np.zeros(1, dtype=np.int64).tofile(self._offsets)
        except OSError as e:
            raise self._write_error(e, 1 << 16) from None
        self._tokens = 0
        self._samples = 0
        self._carry = np.zeros(0, dtype=bool)  # mask bits not yet a whole byte

    def add(self, samples: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """Appends a piece's kept samples ((ids int64 [S], mask bool [S]) each), in file order."""
        if not samples:
            return
        ids = np.concatenate([s[0] for s in samples])  # [T]
        if self.dtype == "uint32" and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFFFFFF):
            raise DataError(
                f"{self.label}: a token id outside 0..2^32-1 (the tokenizer has {len(self._vocab)} tokens). "
                "Pre-tokenize with the target's tokenizer"
            )
        try:
            self._write(samples, ids)
        except OSError as e:
            raise self._write_error(e, ids.nbytes) from None

    def _write(self, samples: Sequence[tuple[np.ndarray, np.ndarray]], ids: np.ndarray) -> None:
        ids.astype(_ID_DTYPES[self.dtype], copy=False).tofile(self._ids)
        bits = np.concatenate([self._carry, *(s[1] for s in samples)])  # [carry + T]
        whole = bits.size - bits.size % 8
        np.packbits(bits[:whole], bitorder="little").tofile(self._mask)
        self._carry = bits[whole:]
        ends = self._tokens + np.cumsum([len(s[0]) for s in samples], dtype=np.int64)
        ends.tofile(self._offsets)
        self._tokens = int(ends[-1])
        self._samples += len(samples)

    @property
    def count(self) -> int:
        return self._samples

    def commit(self, left_out: dict[str, Any]) -> StoredSamples:
        """Writes ``meta.json`` (``left_out``: ``LoadedData``'s counting fields) and moves the store into
        place, replacing an older one; returns its samples."""
        meta = {"key": self.key, "samples": self._samples, "tokens": self._tokens, "ids": self.dtype}
        meta["left_out"] = left_out
        try:
            np.packbits(self._carry, bitorder="little").tofile(self._mask)
            self._close_files()
            (self._partial / META).write_text(json.dumps(meta, indent=1))
            shutil.rmtree(self.root, ignore_errors=True)
            os.rename(self._partial, self.root)
        except OSError as e:
            raise self._write_error(e, 1 << 16) from None
        return StoredSamples(self.root)

    def _write_error(self, exc: OSError, needed: int) -> Exception:
        """A full disk as ``DiskFullError``; any other write failure a ``DataError`` naming the folder."""
        from dflash_pipe.diskspace import is_no_space, no_space_error

        if is_no_space(exc, self._partial, needed):
            return no_space_error(
                self._partial,
                needed,
                what=f"the tokenized samples of {self.label}",
                fix="Free space there, or use a --run-dir on a disk with room for ~4 bytes per token",
            )
        return DataError(
            f"{self._partial}: cannot write the tokenized samples of {self.label} ({exc.strerror or exc}). "
            "Check that the run directory is writable"
        )

    def _close_files(self) -> None:
        for f in (self._ids, self._mask, self._offsets):
            f.close()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_files()
        shutil.rmtree(self._partial, ignore_errors=True)


class StoredSamples(Sequence[Sample]):
    """The samples of a store (or a contiguous part: ``[start, stop)``) as a read-only sequence of
    ``Sample``s; ``sample_id`` is the index in the whole store, as for the in-memory list. Each access
    copies one sample out of the memory maps; pickling reopens the files (it never copies the data)."""

    def __init__(self, root: Path, start: int = 0, stop: int | None = None) -> None:
        self.root = Path(root)
        meta = json.loads((self.root / META).read_text())
        n, tokens, dtype = int(meta["samples"]), int(meta["tokens"]), _ID_DTYPES[meta["ids"]]
        sizes = {IDS: tokens * np.dtype(dtype).itemsize, MASK: (tokens + 7) // 8, OFFSETS: (n + 1) * 8}
        for name, size in sizes.items():
            if (self.root / name).stat().st_size != size:
                raise ValueError(f"{self.root / name}: {(self.root / name).stat().st_size} bytes, not {size}")
        self._offsets = np.memmap(self.root / OFFSETS, dtype=np.int64, mode="r", shape=(n + 1,))
        if int(self._offsets[-1]) != tokens:
            raise ValueError(f"{self.root / OFFSETS}: ends at {int(self._offsets[-1])}, not {tokens}")
        self._ids = np.memmap(self.root / IDS, dtype=dtype, mode="r", shape=(tokens,))
        self._mask = np.memmap(self.root / MASK, dtype=np.uint8, mode="r", shape=((tokens + 7) // 8,))
        self._start, self._stop = start, n if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> Sample: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Sample]: ...

    def __getitem__(self, index: int | slice) -> Sample | Sequence[Sample]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            view = object.__new__(StoredSamples)  # the same maps, another range (copy would reopen them)
            view.__dict__.update(self.__dict__)
            view._start, view._stop = self._start + start, self._start + max(start, stop)
            return view
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        return self._sample(self._start + index)

    def _sample(self, i: int) -> Sample:
        import torch  # not at the top: the tokenization workers import this package without torch

        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        ids = np.array(self._ids[a:b], dtype=np.int64)  # [S] a copy: the maps stay read-only
        bits = np.unpackbits(self._mask[a // 8 : (b + 7) // 8], bitorder="little")
        mask = bits[a % 8 : a % 8 + (b - a)].astype(bool)  # [S]
        return Sample(sample_id=i, input_ids=torch.from_numpy(ids), loss_mask=torch.from_numpy(mask))

    def __iter__(self) -> Iterator[Sample]:
        return (self._sample(i) for i in range(self._start, self._stop))

    def token_ids(self) -> np.ndarray:
        """Every token id of this range's samples, one after the other ([T], a read-only view of the map)."""
        return self._ids[int(self._offsets[self._start]) : int(self._offsets[self._stop])]

    def lengths(self) -> np.ndarray:
        """Token count per sample ([N] int64), from the offsets alone."""
        return np.diff(self._offsets[self._start : self._stop + 1])

    def __reduce__(self) -> tuple[Any, ...]:
        return (StoredSamples, (self.root, self._start, self._stop))
