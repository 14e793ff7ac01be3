"""What regeneration would otherwise hold in memory, on disk: the source conversations and the samples
made of the target's replies, as they arrive.

With ``--responses target`` (the default) a run keeps every source conversation (handed out by index to
the target threads) and every regenerated sample (planned by index for every epoch). For a 10M-conversation
set that is tens of GB of Python objects and tensors. Here each lives in an anonymous file of its own in
the run directory (``tempfile.TemporaryFile``: unlinked at once, gone with the process, never a leftover to
clean), and memory holds only a few bytes of offsets per item. The regenerated file stays the record of
what was generated; these are working copies, rebuilt from it and from the source on a resume.
"""

from __future__ import annotations

import os
import tempfile
import threading
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import msgpack
import numpy as np
import torch

from dflash_pipe.diskspace import is_no_space, no_space_error

from .samples import Sample

IDS = np.uint32
"""Token ids on disk: every tokenizer's vocabulary is below 2**32 (regenerated samples are tokenized here)."""


class _AppendFile:
    """An anonymous file written at its end and read at any offset (``pwrite``/``pread``: a reader never
    moves a writer's position, so target threads read while the main thread appends)."""

    def __init__(self, directory: Path, prefix: str) -> None:
        self.directory, self.prefix = Path(directory), prefix
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=directory, prefix=prefix)  # noqa: SIM115 -- close()
        self._fd = self._file.fileno()
        self.size = 0
        self._lock = threading.Lock()

    def append(self, data: bytes) -> int:
        """Writes ``data`` at the end; returns where it starts. A full disk is one ``DiskFullError`` line
        naming the directory (the end does not move: the next append writes over what this one left)."""
        with self._lock:
            start = self.size
            view = memoryview(data)
            try:
                while view:
                    written = os.pwrite(self._fd, view, start + len(data) - len(view))
                    view = view[written:]
            except OSError as exc:
                if is_no_space(exc, self.directory, len(data)):
                    raise no_space_error(
                        self.directory,
                        len(data),
                        what=f"regeneration's working files ({self.prefix.rstrip('-')})",
                        fix="Free space there or move the run dir to a larger disk, then resume: the "
                        "regenerated file keeps every conversation written",
                    ) from None
                raise
            self.size += len(data)
            return start

    def read(self, start: int, length: int) -> bytes:
        return os.pread(self._fd, length, start)

    def close(self) -> None:
        self._file.close()


class SpilledSamples(Sequence[Sample | None]):
    """``n`` sample slots (None until set) whose tokens live in the run dir's anonymous files; memory
    holds 12 bytes a slot. ``samples[i] = sample`` stores a copy; ``samples[i]`` reads one back."""

    def __init__(self, directory: Path, n: int) -> None:
        self._ids = _AppendFile(directory, "regen-ids-")
        self._mask = _AppendFile(directory, "regen-mask-")
        self._start = np.full(n, -1, dtype=np.int64)  # token offset of each sample, -1: none yet
        self._length = np.zeros(n, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._start)

    def __setitem__(self, index: int, sample: Sample) -> None:
        ids = sample.input_ids.numpy().astype(IDS, copy=False)
        if ids.size and int(sample.input_ids.max()) >= 2**32:
            raise ValueError(f"sample {index}: a token id does not fit 32 bits")
        start_byte = self._ids.append(ids.tobytes())
        try:
            self._mask.append(sample.loss_mask.numpy().astype(np.uint8).tobytes())
        except Exception:
            self._ids.size = start_byte  # both files stay in step: the next sample writes over it
            raise
        start = start_byte // ids.itemsize
        self._length[index] = ids.size
        self._start[index] = start  # last: a reader sees the slot only once its bytes are written

    @overload
    def __getitem__(self, index: int) -> Sample | None: ...
    @overload
    def __getitem__(self, index: slice) -> list[Sample | None]: ...

    def __getitem__(self, index: int | slice) -> Sample | None | list[Sample | None]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start, length = int(self._start[index]), int(self._length[index])
        if start < 0:
            return None
        width = np.dtype(IDS).itemsize
        ids = np.frombuffer(self._ids.read(start * width, length * width), dtype=IDS)
        mask = np.frombuffer(self._mask.read(start, length), dtype=np.uint8)
        sample_id = index if index >= 0 else len(self) + index
        return Sample(sample_id, torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(bool)))

    def __iter__(self) -> Iterator[Sample | None]:
        return (self[i] for i in range(len(self)))

    def lengths(self) -> np.ndarray:
        """Tokens per slot ([N] int64; 0 where no sample is set), without reading any sample."""
        return self._length.astype(np.int64)

    def present(self) -> np.ndarray:
        """Whether each slot holds a sample ([N] bool)."""
        return self._start >= 0

    def close(self) -> None:
        self._ids.close()
        self._mask.close()


class SpilledConversations(Sequence[list[dict[str, str]]]):
    """Conversations appended in order (msgpack in an anonymous file of the run dir), read by index."""

    def __init__(self, directory: Path) -> None:
        self._file = _AppendFile(directory, "conversations-")
        self._ends = array("q")  # where each conversation's bytes end: 8 bytes of memory a conversation

    def append(self, messages: list[dict[str, str]]) -> None:
        data = msgpack.packb(messages, use_bin_type=True)
        self._ends.append(self._file.append(data) + len(data))

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, index: int) -> list[dict[str, str]]: ...
    @overload
    def __getitem__(self, index: slice) -> list[list[dict[str, str]]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        end = self._ends[index]  # IndexError past either end, negative indexes as a list's
        index %= len(self._ends)
        start = self._ends[index - 1] if index else 0
        return msgpack.unpackb(self._file.read(start, end - start), raw=False)

    def __iter__(self) -> Iterator[list[dict[str, str]]]:
        return (self[i] for i in range(len(self)))

    def close(self) -> None:
        self._file.close()
