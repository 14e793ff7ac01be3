"""A full disk is one line (the path, bytes needed and free, what to do) wherever a run writes: checkpoints
(before writing when the space is known short, or mid-write on a real small file system, the previous
checkpoint intact and no temporary files left), regenerated responses, metrics, the compile cache; and a
checkpoint that fits but leaves no room for the next one is warned about first."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from dflash_pipe import diskspace
from dflash_pipe.data.regenerated import Regenerated, RegenStore
from dflash_pipe.diskspace import DiskFullError, compile_cache_full
from dflash_pipe.run.checkpoint import (
    latest_checkpoint,
    read_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)
from dflash_pipe.telemetry.metrics import JsonlSink

Usage = namedtuple("Usage", "total used free")


def _save(run_dir: Path, step: int, width: int = 16, **kw) -> Path:
    model = torch.nn.Linear(width, width, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return save_checkpoint(
        run_dir, step=step, model=model, drafter_config={"w": width}, optimizer=optimizer, ledger={}, **kw
    )


def _free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(diskspace.shutil, "disk_usage", lambda _p: Usage(1 << 40, 0, free))


def _leftovers(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_checkpoint_known_not_to_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    first = _save(tmp_path, 1)
    _free(monkeypatch, 1000)
    with pytest.raises(DiskFullError) as info:
        _save(tmp_path, 2)
    text = str(info.value)
    assert text.startswith(f"{tmp_path / 'checkpoints'}: no space left for checkpoint step-00000002")
    assert "1000 B free" in text and "needs " in text and "--resume" in text and "\n" not in text
    assert latest_checkpoint(tmp_path) == first and verify_checkpoint(first) is None
    assert not (tmp_path / "checkpoints" / "step-00000002").exists() and _leftovers(tmp_path) == []


def test_torch_zip_writer_failing_on_a_full_disk_becomes_one_line(tmp_path, monkeypatch):
    first = _save(tmp_path, 1)
    need = sum(f.stat().st_size for f in first.iterdir())

    def full_disk_save(*_a, **_k):  # what torch.save says on ENOSPC: no errno, zip internals
        _free(monkeypatch, 10)
        raise RuntimeError(
            "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: "
            "file write failed"
        )

    _free(monkeypatch, 10 * need)
    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(
        DiskFullError, match=r"no space left for checkpoint step-00000002 \(needs .*, 10 B free"
    ):
        _save(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == first and _leftovers(tmp_path) == []


def test_another_write_error_is_not_called_a_full_disk(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def broken(*_a, **_k):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", broken)  # plenty of space: some other fault, raised as it is
    with pytest.raises(RuntimeError, match="file write failed") as info:
        _save(tmp_path, 2)
    assert not isinstance(info.value, DiskFullError)
    assert _leftovers(tmp_path) == []


def test_the_space_check_warns_when_the_next_checkpoint_may_not_fit(tmp_path, monkeypatch):
    first = _save(tmp_path, 1)
    need = sum(f.stat().st_size for f in first.iterdir())
    notes: list[str] = []
    _free(monkeypatch, need * 3)
    _save(tmp_path, 2, warn=notes.append)
    assert notes == []
    _free(monkeypatch, need + need // 2)
    _save(tmp_path, 3, warn=notes.append)
    assert len(notes) == 1 and "this one fits, the next may not" in notes[0], notes
    assert read_trainer_state(latest_checkpoint(tmp_path)).step == 3


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 4 MiB file system (tmpfs; needs root and a kernel that lets this sandbox mount)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_mid_checkpoint_leaves_the_previous_one_and_no_temp_files(small_fs: Path):
    first = _save(small_fs, 1, width=32)
    size = sum(f.stat().st_size for f in first.iterdir())
    filler = small_fs / "filler"
    with open(filler, "wb") as f:  # leave just over the previous checkpoint's size: the check passes
        f.write(b"\0" * (shutil.disk_usage(small_fs).free - size - 16384))
    with pytest.raises(DiskFullError, match="no space left for checkpoint step-00000002"):
        _save(small_fs, 2, width=320)  # ~100x the bytes: the write itself runs out
    assert latest_checkpoint(small_fs) == first and verify_checkpoint(first) is None
    assert _leftovers(small_fs) == [] and not (small_fs / "checkpoints" / "step-00000002").exists()
    filler.unlink()  # space freed: the run checkpoints again
    assert read_trainer_state(_save(small_fs, 2, width=32)).step == 2


class _FullFile:
    """A file object on a full disk."""

    closed = False

    def write(self, _text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self) -> int:
        return -1

    def close(self) -> None:
        self.closed = True
        raise OSError(errno.ENOSPC, "No space left on device")


def test_metrics_on_a_full_disk(tmp_path: Path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink._file.close()
    sink._file = _FullFile()
    with pytest.raises(DiskFullError) as info:
        sink.log({"loss": 1.0}, 3)
    assert str(info.value).startswith(f"{tmp_path / 'metrics.jsonl'}: no space left for a metrics record")
    sink.close()  # already said: closing is quiet


def test_regenerated_responses_on_a_full_disk(tmp_path: Path):
    store = RegenStore(tmp_path / "regenerated.jsonl", {"target": {}, "settings": {}, "source": {}})
    store._file.close()
    store._file = _FullFile()
    record = Regenerated(index=0, messages=[{"role": "assistant", "content": "hi"}], turns=1)
    with pytest.raises(
        DiskFullError, match=r"regenerated.jsonl: no space left for 1 regenerated conversation"
    ):
        store.append([record])
    assert 0 not in store.done  # not counted as written
    store.close()


def test_a_compile_failing_on_a_full_cache_disk_is_named_not_a_compiler_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache" / "x.py"))
        except OSError as inner:
            raise RuntimeError("backend='inductor' raised: OSError") from inner
    except RuntimeError as exc:
        found = compile_cache_full(exc)
    assert found is not None and str(found).startswith(
        f"{tmp_path / 'cache'}: no space left for torch.compile"
    )
    assert "--compile-cache" in str(found)
    assert compile_cache_full(RuntimeError("Triton codegen failed: unsupported dtype")) is None
    json.dumps(str(found))  # one printable line
