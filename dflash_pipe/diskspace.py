"""A full disk, named: which file could not be written, how many bytes it needed, how many are free, and
what to do, in one line (``DiskFullError``), instead of torch's zip internals or a chained traceback.

Every writer of a run (checkpoints, regenerated responses, metrics, the compile cache) turns its write
failure into this error with ``no_space_error`` when ``is_no_space`` says the disk is full: ENOSPC or EDQUOT
anywhere in the exception chain, or a write that failed while less is free than it needed (torch's
``PytorchStreamWriter failed writing file`` keeps no errno). ``space_note`` is the early warning before a
checkpoint: room for this one, not for the next.
"""

from __future__ import annotations

import errno
import getpass
import os
import shutil
import tempfile
from pathlib import Path

_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_NO_SPACE_WORDS = ("no space left", "disk quota exceeded", "file write failed", "failed writing file")


class DiskFullError(OSError):
    """No space left for a run's file; ``str()`` is the whole message (the path, bytes, the fix)."""

    def __init__(self, message: str, *, path: Path, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message, self.path, self.needed, self.free = message, Path(path), needed, free

    def __str__(self) -> str:
        return self.message


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the file system holding ``path`` (or its nearest parent)."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def is_no_space(exc: BaseException, path: Path | None = None, needed: int = 0) -> bool:
    """Whether ``exc`` (or anything in its chain) says the disk is full; a write error of another kind counts
    when ``path``'s file system has less free than the ``needed`` bytes."""
    seen: set[int] = set()
    current: BaseException | None = exc
    write_failed = False
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE_ERRNOS:
            return True
        text = str(current).lower()
        if any(word in text for word in _NO_SPACE_WORDS[:2]):
            return True
        write_failed = write_failed or any(word in text for word in _NO_SPACE_WORDS[2:])
        write_failed = write_failed or isinstance(current, OSError)
        current = current.__cause__ or current.__context__
    return write_failed and path is not None and free_bytes(path) < max(needed, 1)


def no_space_error(path: Path, needed: int, *, what: str, fix: str) -> DiskFullError:
    """The one line: ``PATH: no space left for WHAT (needs N, F free on that file system). FIX``."""
    free = free_bytes(path)
    return DiskFullError(
        f"{path}: no space left for {what} (needs {human(needed)}, {human(free)} free on that file "
        f"system). {fix}",
        path=path,
        needed=needed,
        free=free,
    )


def space_note(path: Path, needed: int, *, what: str, fix: str) -> str | None:
    """The early warning: ``needed`` bytes fit, but not twice (the next one after this would not)."""
    free = free_bytes(path)
    if free >= 2 * needed:
        return None
    return (
        f"{path}: {human(free)} free, {what} takes about {human(needed)}: this one fits, the next may not. "
        f"{fix}"
    )


COMPILE_CACHE_BYTES = 256 << 20
"""About what torch.compile's cache of one run takes (Inductor's and Triton's kernels; measured runs stay
under it): the bytes a compile cache that failed is said to need."""


def compile_cache_dir() -> Path:
    """Where Inductor writes its kernels in this process (the run's compile-cache for a launched worker)."""
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"


def compile_cache_full(exc: BaseException) -> DiskFullError | None:
    """The one line when a compile failed because its cache's disk is full (else None: a compiler failure)."""
    cache = compile_cache_dir()
    if not is_no_space(exc, cache, COMPILE_CACHE_BYTES):
        return None
    return no_space_error(
        cache,
        COMPILE_CACHE_BYTES,
        what="torch.compile's kernels",
        fix="Free space there or point the compile cache at a larger disk (`launch --config` key "
        "compile_cache, `worker --compile-cache`, or TORCHINDUCTOR_CACHE_DIR), then resume",
    )
