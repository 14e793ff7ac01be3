"""A folder's manifest (``manifest.json``: each file's size and the sha256 of its pieces, hashed as read back
from disk once written), and file modes from the umask.

Checkpoints (``run.checkpoint``) and exports (``drafter.export``) both carry one, so a reader can tell the
files as written from files damaged since (``check_manifest``). safetensors creates its files 0600 whatever
the umask; ``chmod_from_umask`` gives a written file the mode the process umask says (0644 under umask 022),
so a serving container running as another user can read a checkpoint or an export.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CHUNK_BYTES = 64 << 20
"""The manifest hashes files in pieces of this size, so a big file hashes on several cores."""
_READ_BYTES = 8 << 20
_HASH_THREADS = min(8, os.cpu_count() or 1)


def write_manifest(path: Path, names: Iterable[str] | None = None) -> None:
    """``path/manifest.json``: each file (``names``, default every file in ``path``) with its size and the
    sha256 of each of its ``CHUNK_BYTES`` pieces, hashed as read back from disk, so what is recorded is what
    was written."""
    path = Path(path)
    if names is None:
        names = (f.name for f in path.iterdir() if f.is_file() and f.name != MANIFEST)
    files = {
        name: {
            "bytes": (path / name).stat().st_size,
            "chunk_bytes": CHUNK_BYTES,
            "sha256": file_digests(path / name),
        }
        for name in sorted(names)
    }
    write_json(path / MANIFEST, {"format": 1, "files": files})


def check_manifest(
    path: Path, files: Sequence[str] | None = None, required: Sequence[str] = ()
) -> str | None:
    """What is wrong with the files of ``path`` against its manifest (one phrase naming the file), or None if
    they match: the manifest must list each of ``required``, and each of ``files`` (default: all it lists)
    must be there with its recorded size and sha256."""
    path = Path(path)
    manifest = path / MANIFEST
    try:
        entries = json.loads(manifest.read_text())["files"]
        listed = {
            name: (int(e["bytes"]), list(e["sha256"]), int(e["chunk_bytes"])) for name, e in entries.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{manifest} is unreadable ({type(e).__name__}: {e})"
    for name in (*required, *(files or ())):
        if name not in listed:
            return f"{manifest} does not list {name}"
    for name in files or listed:
        size, digests, chunk = listed[name]
        f = path / name
        if not f.exists():
            return f"{f} is missing (its manifest lists it)"
        try:
            actual = f.stat().st_size
            if actual != size:
                return f"{f} has {actual} bytes, its manifest says {size} (cut short or overwritten)"
            if file_digests(f, chunk) != digests:
                return f"{f} does not match its sha256 in {MANIFEST} (changed or damaged on disk)"
        except OSError as e:
            return f"{f} cannot be read ({e.strerror or e})"
    return None


def file_digests(path: Path, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """The sha256 of each ``chunk_bytes`` piece of a file (one piece under that size: its plain sha256), hashed
    on several threads: hashlib releases the GIL, and one core hashes only ~1 GB/s (a 12.6 GB checkpoint of the
    Qwen3-8B drafter took 13 s on one core of the H200 host)."""
    size = Path(path).stat().st_size
    starts = range(0, max(size, 1), chunk_bytes)
    threads = min(len(starts), _HASH_THREADS)
    if threads <= 1:
        return [_chunk_sha256(path, start, chunk_bytes) for start in starts]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dflash-sha256") as pool:
        return list(pool.map(lambda start: _chunk_sha256(path, start, chunk_bytes), starts))


def _chunk_sha256(path: Path, start: int, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left > 0 and (block := f.read(min(_READ_BYTES, left))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON, flushed to disk before returning."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (``os.umask`` can only be read by
    setting it, which for a moment would give files other threads create a wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_from_umask(path: Path) -> None:
    """Gives a file this process wrote the mode a plain ``open(path, "w")`` would have (0666 less the umask):
    safetensors and tempfile create theirs 0600."""
    os.chmod(path, 0o666 & ~current_umask())
