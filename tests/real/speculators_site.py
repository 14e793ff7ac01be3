"""speculators 0.9.0 (vllm-project/speculators, the second DFlash peer) for the tests, from the package
index, cached between runs.

speculators pins transformers <= 5.19, datasets <= 5.1 and torchvision/torchaudio, none of which its DFlash
model and trainer need here, so it is not installed into the venv: ``pip install --no-deps --target`` puts
the pinned packages below (and only those) into a folder that a test puts on ``sys.path``, under the
venv's own torch, transformers and datasets (``datasets`` comes with the ``test`` extra). The list is what
``import speculators.train.cli`` (model, data loader, trainer) reaches that the venv lacks: importing any
part of speculators imports its data loader, which imports ``openai`` and ``datasets``.

Cached under ``$DFLASH_PIPE_CACHE/speculators-site/speculators-<version>-py<X.Y>`` (default
``~/.cache/dflash-pipe``), made once as ``packages.py`` makes its folder (``cached_folder``). ``RegistryUnreachable`` when pip cannot reach the index (the tests
skip); any other failure is an error naming pip's output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.drafter.reference_venv import RegistryUnreachable
from tests.real.packages import cached_folder, run_pip

PINS = {
    "speculators": "0.9.0",
    "hs-connectors": "0.9.0",  # its hidden-state file transfer (the trainer's data loader reads through it)
    "openai": "3.63.0",  # imported by its data loader (on-demand generation, unused here)
    "httpx": "0.29.0",  # openai's
    "sniffio": "1.3.1",  # openai's
    "loguru": "0.7.3",  # its converters' logging
    "pydantic-settings": "2.16.3",  # its typed train config
    "python-dotenv": "1.2.4",  # pydantic-settings'
}
"""Pinned as found on the index on 2026-12-08; the DFlash code read and tested is speculators 0.9.0's."""
MARKER = ".dflash-pipe-complete"
INSTALL_TIMEOUT_S = 1200

__all__ = ["PINS", "RegistryUnreachable", "site_dir", "speculators_site"]


def site_dir() -> Path:
    """Where the packages live: one folder per set of pins and Python version."""
    root = os.environ.get("DFLASH_PIPE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "dflash-pipe"
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return base / "speculators-site" / f"speculators-{PINS['speculators']}-{py}"


def speculators_site() -> Path:
    """A folder to put on ``sys.path`` (or PYTHONPATH) to import speculators, installed first when missing.
    Raises ``RegistryUnreachable`` when pip cannot reach the index, RuntimeError when it fails otherwise."""
    folder = site_dir()
    cached_folder(folder, PINS, _install)
    return folder


def _install(dest: Path) -> None:
    requirements = [f"{name}=={version}" for name, version in PINS.items()]
    run_pip(
        ["install", "-q", "--no-compile", "--target", str(dest), *requirements], timeout=INSTALL_TIMEOUT_S
    )
