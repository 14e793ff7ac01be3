"""A virtual environment of its own for the DFlash reference package (``dflash`` on the package index), so
that a test can load our exports with the reference's own code, in a process that cannot import dflash_pipe.

The venv is cached between runs under ``$DFLASH_PIPE_CACHE/reference-venv/<pins>`` (default
``~/.cache/dflash-pipe``), keyed by the pinned versions and the Python that made it; one missing its
completion marker, or whose imports fail, is deleted and built again. Built with ``python -m venv``, then
``pip install torch==TORCH`` first (a bare torch requirement would pull a CUDA build), then
``dflash[local]==DFLASH`` (its ``local`` extra pins torch and transformers), ``--no-compile``: byte-compiling
torch's and transformers' files after the install took longer than the install itself (2 cores: 106 s of CPU
against 42 s without), and the one process that imports them compiles only what it imports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

DFLASH = "0.1.0"
TORCH = "2.13.0"
TRANSFORMERS = "5.15.0"
"""What ``dflash[local]==DFLASH`` pins on Linux (its METADATA)."""
PINS = {"dflash": DFLASH, "torch": TORCH, "transformers": TRANSFORMERS}
MARKER = ".dflash-pipe-complete"
INSTALL_TIMEOUT_S = 1800

# pip's words for "could not reach the index" (urllib3 / requests / socket errors it prints while retrying)
_NETWORK_ERRORS = (
    "NewConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "connection broken",
)

_CHECK = f"""
import importlib.metadata as m, sys
pins = {PINS!r}
got = {{name: m.version(name).split("+")[0] for name in pins}}
assert got == pins, got
from dflash.model import DFlashDraftModel, dflash_generate  # noqa: F401 (imports torch and transformers)
"""


class RegistryUnreachable(RuntimeError):
    """The package index could not be reached, so the reference venv cannot be built here."""


def network_error_line(output: str) -> str | None:
    """pip's line saying it could not reach the package index, or None when ``output`` has none."""
    return next(
        (line.strip() for line in output.splitlines() if any(w in line for w in _NETWORK_ERRORS)), None
    )


def venv_dir() -> Path:
    """Where the reference venv lives: one directory per set of pins and Python version."""
    root = os.environ.get("DFLASH_PIPE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "dflash-pipe"
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return base / "reference-venv" / f"dflash-{DFLASH}-torch-{TORCH}-transformers-{TRANSFORMERS}-{py}"


def reference_python() -> Path:
    """The Python of a working reference venv, built first when it is missing or broken.

    Raises ``RegistryUnreachable`` when it has to be built and pip cannot reach the package index, and a
    RuntimeError with pip's output when the install fails for another reason."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if _works(venv):
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(venv.with_name(venv.name + ".lock"))):
        if _works(venv):  # another process built it while we waited
            return python
        shutil.rmtree(venv, ignore_errors=True)
        _check_registry()
        subprocess.run(
            [sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300
        )
        _pip(python, f"torch=={TORCH}")
        _pip(python, f"dflash[local]=={DFLASH}")
        if not _works(venv, marker=False):
            raise RuntimeError(
                f"{venv}: dflash[local]=={DFLASH} installed, but its imports or versions are wrong "
                f"(want {PINS}); delete {venv} and run again, or update the pins in {__file__}"
            )
        (venv / MARKER).write_text(json.dumps(PINS) + "\n")
    return python


def _works(venv: Path, *, marker: bool = True) -> bool:
    """Whether ``venv`` is complete (its marker, unless ``marker=False``) and imports the pinned versions."""
    python = venv / "bin" / "python"
    if not python.exists() or (marker and not (venv / MARKER).is_file()):
        return False
    proc = subprocess.run([str(python), "-I", "-c", _CHECK], capture_output=True, text=True, timeout=300)
    return proc.returncode == 0


def _check_registry() -> None:
    """Asks pip (with few retries and a short timeout) for the reference's wheel; ``RegistryUnreachable``
    when it fails on a network error."""
    with tempfile.TemporaryDirectory(prefix="dflash-reference-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--retries", "1"]
            + ["--timeout", "20", "-d", tmp, f"dflash=={DFLASH}"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if (line := network_error_line(output)) is not None:
            raise RegistryUnreachable(f"pip could not reach the package index: {line[-240:]}")
        raise RuntimeError(f"pip download dflash=={DFLASH} failed:\n{output[-3000:]}")


def _pip(python: Path, requirement: str) -> None:
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "--disable-pip-version-check",
            requirement,
        ],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if network_error_line(output) is not None:
            raise RegistryUnreachable(f"pip install {requirement} could not reach the package index")
        raise RuntimeError(f"pip install {requirement} into {python.parent.parent} failed:\n{output[-3000:]}")
