"""Tables through the ``datasets`` library: the optional ``data`` extra, ``save_to_disk`` folders, and Hub
dataset ids resolved from the local caches only (the ``datasets`` cache that ``load_dataset`` prepares,
then the Hub file cache that ``hf download --repo-type dataset`` fills).

``datasets`` is imported here and only when ``--data`` names a table, so JSONL runs never pay for it (or
need it installed). It is used to find the files (a ``DatasetDict``'s splits, the cache layout of a Hub id);
the rows are then read from those files in record batches (``tables.py``), never loaded whole. A run never
downloads: Hub ids are looked up with offline mode on and ``local_files_only``, and one that is not in the
cache is one error line naming the id, the cache dir and what to do.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .resolved import ARROW, PARQUET, HubSpec, TableSource
from .samples import DataError

INSTALL = "pip install 'dflash-pipe[data]'"
SPLIT_NAMES = ("train", "validation", "valid", "dev", "test", "eval")
"""Folder names and file-name words that name a split in a Hub repo's data files."""


def require_datasets(label: str) -> Any:
    """The ``datasets`` module, or a one-line ``DataError`` saying how to install it."""
    try:
        import datasets
        import pyarrow  # noqa: F401 -- datasets depends on it; the readers use it directly
    except ImportError as exc:
        raise DataError(
            f"{label}: reading parquet, arrow or Hugging Face datasets needs the datasets library "
            f"({exc.name or 'datasets'} is not installed). Install it with {INSTALL}, or pass a JSONL file"
        ) from None
    return datasets


def file_source(label: str, files: tuple[Path, ...], kind: str) -> TableSource:
    """Parquet or arrow files named directly (a file, a folder of shards or a glob), in this order."""
    require_datasets(label)
    rows = _parquet_rows(files) if kind == PARQUET else None
    many = f"{len(files)} {kind} shards" if len(files) > 1 else f"{kind} file"
    return TableSource(label=label, files=files, kind=kind, rows=rows, what=many)


def disk_source(label: str, folder: Path) -> TableSource:
    """A ``Dataset.save_to_disk`` folder, or a ``DatasetDict``'s (its ``train`` split, or its only one)."""
    datasets = require_datasets(label)
    try:
        loaded = datasets.load_from_disk(str(folder))  # memory-maps the files: nothing is read yet
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{label}: not a readable datasets save_to_disk folder ({_first_line(exc)}). Save it again with "
            "Dataset.save_to_disk, or pass its parquet/arrow files"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        split = pick_split(label, list(loaded), f"pass the split's folder, e.g. {folder / 'SPLIT'}")
        return _dataset_source(label, loaded[split], f"save_to_disk folder, split {split}")
    return _dataset_source(label, loaded, "save_to_disk folder")


def hub_source(label: str, spec: HubSpec) -> TableSource:
    """A Hub dataset id as the local ``datasets`` cache holds it (what ``load_dataset(id)`` once prepared
    there, online). Never downloads; not cached: a ``DataError`` naming the id, the cache and the fix."""
    datasets = require_datasets(label)
    cache = datasets_cache_dir()
    with offline(datasets):
        try:
            loaded = datasets.load_dataset(
                spec.repo_id,
                spec.config,
                split=spec.split,
                cache_dir=str(cache),
                download_mode="reuse_dataset_if_exists",
                download_config=datasets.DownloadConfig(local_files_only=True),
            )
        except (ConnectionError, FileNotFoundError) as exc:
            files = hub_file_source(label, spec)
            if files is not None:
                return files
            raise DataError(not_cached_message(label, spec, cache, exc)) from None
        except ValueError as exc:  # cached, but not this config or split
            raise DataError(
                f"{label}: the cached dataset {spec.repo_id} has no such config or split ({_first_line(exc)}). "
                "Name one it has: --data ORG/NAME:SPLIT or ORG/NAME:CONFIG:SPLIT"
            ) from None
    if isinstance(loaded, datasets.DatasetDict):
        split = pick_split(label, list(loaded), f"name one: --data {spec.repo_id}:SPLIT")
        loaded = loaded[split]
    else:
        split = spec.split
    return _dataset_source(
        label, loaded, f"Hub dataset {spec.repo_id}, split {split}, from the cache {cache}"
    )


def not_cached_message(label: str, spec: HubSpec, cache: Path, exc: BaseException) -> str:
    """One line: the id is in neither cache; runs never download; how to get it there, or what else to pass."""
    args = repr(spec.repo_id) + (f", {spec.config!r}" if spec.config else "")
    return (
        f"{label}: the Hugging Face dataset {spec.repo_id} is not in the local datasets cache {cache} "
        f"({_first_line(exc)}) nor in the Hub file cache {hub_cache_dir()}; dflash-pipe never downloads data "
        "during a run. Download it once beforehand (online, with the same HF_HOME): hf download "
        f'--repo-type dataset {spec.repo_id}, or python -c "import datasets; datasets.load_dataset({args})", '
        "or pass a local path (parquet, arrow, a save_to_disk folder, JSONL)"
    )


def hub_file_source(label: str, spec: HubSpec) -> TableSource | None:
    """The id's parquet shards as ``hf download --repo-type dataset`` leaves them in the Hub file cache
    (the snapshot ``refs/main`` points at), for the asked split (default: ``train``, or the only one); None
    when the cache holds no snapshot of the id. A file's split is a folder of its path or its name's
    first word (``data/train-00000-of-00002.parquet``, ``test/0.parquet``), as the Hub's viewer reads it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        root = Path(
            snapshot_download(
                spec.repo_id, repo_type="dataset", cache_dir=str(hub_cache_dir()), local_files_only=True
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    shards = sorted(p for p in root.rglob("*.parquet") if p.is_file())
    if spec.config is not None:
        shards = [p for p in shards if spec.config in p.relative_to(root).parts[:-1]]
    by_split: dict[str, list[Path]] = {}
    for shard in shards:
        by_split.setdefault(_split_of(shard.relative_to(root)), []).append(shard)
    where = f"the Hub file cache's snapshot {root}"
    if not by_split:
        raise DataError(
            f"{label}: {where} holds no parquet files{' for config ' + spec.config if spec.config else ''}. "
            "Pass its data files as a local path (a file, a folder or a glob)"
        )
    split = spec.split or pick_split(label, sorted(by_split), f"name one: --data {spec.repo_id}:SPLIT")
    if split not in by_split:
        raise DataError(
            f"{label}: {where} has no split {split!r} (it has {', '.join(sorted(by_split))}). "
            f"Name one it has: --data {spec.repo_id}:SPLIT"
        )
    return file_source(label, tuple(by_split[split]), PARQUET)


def _split_of(relative: Path) -> str:
    """``data/train-00000-of-00001.parquet`` -> train, ``default/test/0000.parquet`` -> test; a file that
    names no split is ``train`` (as the Hub reads a repo without split names)."""
    for part in relative.parts[:-1]:
        if part in SPLIT_NAMES:
            return part
    word = re.split(r"[-_.]", relative.name)[0]
    return word if word in SPLIT_NAMES else "train"


def hub_cache_dir() -> Path:
    """Where ``huggingface_hub`` keeps downloaded repo files: HF_HUB_CACHE, else HF_HOME/hub."""
    return _hf_cache("HF_HUB_CACHE", "hub")


def pick_split(label: str, splits: list[str], how: str) -> str:
    """``train`` when the dataset has it, its only split otherwise, else a ``DataError`` listing them."""
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise DataError(f"{label}: the dataset has splits {', '.join(splits)} and none is 'train'; {how}")


def datasets_cache_dir() -> Path:
    """Where ``datasets`` keeps prepared datasets: HF_DATASETS_CACHE, else HF_HOME/datasets."""
    return _hf_cache("HF_DATASETS_CACHE", "datasets")


def _hf_cache(variable: str, folder: str) -> Path:
    """``$variable``, else ``HF_HOME/folder`` (HF_HOME: else ``$XDG_CACHE_HOME/huggingface``, else
    ``~/.cache/huggingface``), read from the environment now: the libraries read it once, at import."""
    if os.environ.get(variable):
        return Path(os.environ[variable]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(home).expanduser() / folder


@contextlib.contextmanager
def offline(datasets: Any) -> Iterator[None]:
    """``datasets`` in offline mode (no Hub request at all) and quiet (its cache notes are not ours)."""
    config = datasets.config
    saved = config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE
    verbosity = datasets.logging.get_verbosity()
    config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE = saved
        datasets.logging.set_verbosity(verbosity)


def _dataset_source(label: str, ds: Any, what: str) -> TableSource:
    """A ``datasets.Dataset`` backed by arrow files, as those files (read later in record batches)."""
    files = tuple(Path(f["filename"]) for f in ds.cache_files)
    if not files or ds._indices is not None:  # in memory, or a selection over its files: not its files' rows
        raise DataError(
            f"{label}: this dataset's rows are not its arrow files' rows in order (it holds an index "
            "mapping or lives in memory). Write it out with Dataset.save_to_disk and pass that folder"
        )
    return TableSource(label=label, files=files, kind=ARROW, rows=ds.num_rows, what=what)


def _parquet_rows(files: tuple[Path, ...]) -> int | None:
    import pyarrow.parquet as pq

    try:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    except Exception:  # a damaged file: the reader reports it with its name
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
