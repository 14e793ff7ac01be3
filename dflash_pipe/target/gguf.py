"""A GGUF file as a target: turned once into a plain Hugging Face folder, which is all the rest sees.

``resolve_target(path)`` is the one call at the edge: a folder comes back as it is; a ``.gguf`` file is
dequantized with transformers' GGUF loader (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``,
which needs the packages ``gguf`` and ``accelerate``: ``pip install 'dflash-pipe[gguf]'``) and saved as a
normal folder (safetensors weights, config.json, tokenizer, generation config) in a cache folder keyed by
the file's name, size and mtime, under ``$DFLASH_PIPE_CACHE/gguf`` (default ``~/.cache/dflash-pipe/gguf``).
The weights keep the dtype the loader gives, float32: the dequantized values exactly (a Q4/Q8 block's
scale times its integers is exact in float32, not in bfloat16); the producer casts to its compute dtype
when it loads the target, as for any folder. The folder is written in a temporary folder beside it and
renamed into place once complete, under a file lock, so two processes converting the same file at once
convert it once and a killed conversion leaves no folder. ``SOURCE_FILE`` in it records which GGUF file
it came from.

Every way this fails (no such file, the packages missing, an architecture transformers cannot load, a
damaged file, a cache folder that cannot be written; a folder without config.json) is one
``TargetPathError`` line naming the path and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
SOURCE_FILE = "dflash_pipe_gguf.json"
"""Written last into a converted folder: the GGUF file it came from (path, size, mtime), the transformers
version that dequantized it and the dtype it was saved in."""
EXTRA_INSTALL = "pip install 'dflash-pipe[gguf]'"
_NEEDS = ("gguf", "accelerate")


def say_line(line: str) -> None:
    """The default ``say``: the line on stdout, flushed (before the loader's progress bars on stderr)."""
    print(line, flush=True)


class TargetPathError(ValueError):
    """A target path that is no loadable target (no such file, a folder without config.json, a GGUF file
    that cannot be converted), in one line: the path, why, and the fix."""


def is_gguf(path: str | Path | None) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; a folder never is)."""
    return path is not None and Path(path).suffix.lower() == GGUF_SUFFIX and not Path(path).is_dir()


def cache_root() -> Path:
    """Where converted GGUF targets live: ``$DFLASH_PIPE_CACHE/gguf`` or ``~/.cache/dflash-pipe/gguf``."""
    root = os.environ.get("DFLASH_PIPE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "dflash-pipe"
    return base / "gguf"


def converted_folder(gguf_path: str | Path, root: Path | None = None) -> Path:
    """The folder this GGUF file converts to (converted or not): ``<name>-<size>-<mtime_ns>`` under
    ``root`` (default ``cache_root()``); a changed file gets a new folder."""
    path = Path(gguf_path)
    st = path.stat()
    return (root or cache_root()) / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def gguf_source(folder: str | Path) -> dict[str, Any] | None:
    """What a converted folder records about its GGUF file (``SOURCE_FILE``), None for any other folder."""
    try:
        data = json.loads((Path(folder) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def resolve_target(
    path: str | Path | None,
    *,
    flag: str = "--target-model",
    say: Callable[[str], None] | None = say_line,
    root: Path | None = None,
) -> Path | None:
    """The Hugging Face folder of a target: ``path`` itself (None stays None: the demo target), or for a
    GGUF file its converted folder (``gguf_folder``). ``flag``: how the user gave the path, for errors.
    Raises ``TargetPathError``, also for a folder without config.json."""
    if path is None:
        return None
    if is_gguf(path):
        return gguf_folder(path, flag=flag, say=say, root=root)
    if not (Path(path) / "config.json").is_file():
        raise TargetPathError(
            f"{flag} {path}: no config.json there. Pass a Hugging Face model directory (config.json + "
            "safetensors + tokenizer) or a GGUF file"
        )
    return Path(path)


def gguf_folder(
    gguf_path: str | Path,
    *,
    flag: str = "--target-model",
    say: Callable[[str], None] | None = say_line,
    root: Path | None = None,
) -> Path:
    """The converted folder of a GGUF file, converted first if it is not in the cache yet (one line through
    ``say`` either way). Raises ``TargetPathError``."""
    from filelock import FileLock

    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise TargetPathError(
            f"{flag} {path}: no such file. Pass a GGUF file or a Hugging Face model directory "
            "(config.json + safetensors + tokenizer)"
        )
    folder = converted_folder(path, root)
    if gguf_source(folder) is None:
        missing = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
        if missing:
            raise TargetPathError(
                f"{flag} {path}: a GGUF target needs the package(s) {' and '.join(missing)}: {EXTRA_INSTALL}"
            )
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(folder) + ".convert-lock"):
                if gguf_source(folder) is None:  # not converted by another process while we waited
                    if say is not None:
                        say(f"GGUF target {path}: converting it once to a Hugging Face folder at {folder}")
                    _convert(path, folder, flag=flag)
                    return folder
        except OSError as exc:  # the cache not writable, a full disk
            raise TargetPathError(
                f"{flag} {path}: cannot write its converted folder {folder} ({exc}). Free space there, or "
                "set DFLASH_PIPE_CACHE to a writable folder"
            ) from None
    if say is not None:
        say(f"GGUF target {path}: using its converted folder {folder}")
    return folder


def _convert(path: Path, folder: Path, *, flag: str) -> None:
    """Dequantizes ``path`` into a temporary folder beside ``folder`` and renames it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        _write_folder(path, tmp, flag=flag)
        if folder.exists():  # a torn folder without SOURCE_FILE (written by hand, or an older layout)
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_folder(path: Path, out: Path, *, flag: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # the loader's errors are of many types; each becomes the one line below
        raise TargetPathError(_load_error(path, exc, flag)) from None
    config = model.config
    if hasattr(config, "quantization_config"):  # the folder holds plain weights: nothing to dequantize
        del config.quantization_config
    with torch.device("meta"):  # a plain model of that config takes the dequantized weights, strictly
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _write_rope_theta(out / "config.json")
    st = path.stat()
    source = {
        "gguf": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "transformers": transformers.__version__,
        "dtype": str(plain.dtype).removeprefix("torch."),
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _write_rope_theta(config_json: Path) -> None:
    """``rope_theta`` at the top level too: transformers 4.x reads it there, 5.x from ``rope_parameters``."""
    data = json.loads(config_json.read_text())
    params = data.get("rope_parameters")
    if "rope_theta" not in data and isinstance(params, dict) and "rope_theta" in params:
        data["rope_theta"] = params["rope_theta"]
        config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _load_error(path: Path, exc: Exception, flag: str) -> str:
    import transformers

    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = f"{flag} {path}: transformers {transformers.__version__} cannot load this GGUF file ({reason})."
    if "not supported" in reason:
        try:
            from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

            names = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # not models
            text += f" GGUF architectures it loads: {', '.join(names)}."
        except ImportError:
            pass
    return text + " Pass a Hugging Face model directory of that model instead, or a newer transformers"
