"""An export carries a manifest (sizes, sha256) and loading checks it: a damaged export is refused in one
line naming the file and how to export again; an export without a manifest (older) loads, unverified."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import warnings
from pathlib import Path

import pytest
import torch

from dflash_pipe.drafter.export import (
    CONFIG_NAME,
    MODELING_NAME,
    WEIGHTS_NAME,
    ExportError,
    UnverifiedExportWarning,
    export_drafter,
    load_exported,
    verify_export,
)
from dflash_pipe.run.manifest import CHUNK_BYTES, MANIFEST

from .conftest import tiny_drafter


def _load(path: Path, model, **kwargs):
    return load_exported(path, embed_tokens=model.embed_tokens, lm_head=model.lm_head, **kwargs)


def _flip_weight_byte(root: Path) -> None:
    """One bit of one tensor's data (past the safetensors header): the file still parses."""
    path = root / WEIGHTS_NAME
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + 17] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(root: Path) -> None:
    path = root / WEIGHTS_NAME
    path.write_bytes(path.read_bytes()[:-100])


def _damage_header(root: Path) -> None:
    path = root / WEIGHTS_NAME
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # inside the JSON header: no longer UTF-8
    path.write_bytes(bytes(data))


def test_the_export_writes_a_manifest_of_its_own_files(tmp_path) -> None:
    (tmp_path / "README.md").write_text("not the export's")
    export_drafter(tiny_drafter(), tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["format"] == 1 and sorted(manifest["files"]) == [CONFIG_NAME, WEIGHTS_NAME, MODELING_NAME]
    for name, entry in manifest["files"].items():
        data = (tmp_path / name).read_bytes()
        assert entry == {
            "bytes": len(data),
            "chunk_bytes": CHUNK_BYTES,
            "sha256": [hashlib.sha256(data).hexdigest()],
        }
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]  # temp files renamed into place
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verified: no warning
        verify_export(tmp_path)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_flip_weight_byte, f"{WEIGHTS_NAME} does not match its sha256 in {MANIFEST}"),
        (_truncate, f"{WEIGHTS_NAME} has "),
        (_damage_header, f"{WEIGHTS_NAME} does not match its sha256 in {MANIFEST}"),
        (lambda root: (root / WEIGHTS_NAME).unlink(), f"{WEIGHTS_NAME} is missing (its manifest lists it)"),
        (lambda root: (root / CONFIG_NAME).write_text("{}\n"), f"{CONFIG_NAME} has "),
        (lambda root: (root / MANIFEST).write_text("{"), f"{MANIFEST} is unreadable"),
        (
            lambda root: (root / MODELING_NAME).write_text(
                (root / MODELING_NAME).read_text() + "import os\n"
            ),
            f"{MODELING_NAME} has ",  # the code trust_remote_code would run is verified too
        ),
    ],
    ids=["flipped-byte", "truncated", "header", "missing-weights", "config", "manifest", "modeling-code"],
)
def test_a_damaged_export_is_refused_in_one_line(tmp_path, damage, expected) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    damage(tmp_path)
    with pytest.raises(ExportError) as info:
        _load(tmp_path, model)
    message = str(info.value)
    assert expected in message, message
    assert "\n" not in message
    assert f"the export in {tmp_path} is damaged" in message
    assert f"dflash-pipe export RUN_DIR {tmp_path}" in message  # what to do


def test_an_export_without_a_manifest_loads_with_one_warning(tmp_path) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    (tmp_path / MANIFEST).unlink()
    with pytest.warns(UnverifiedExportWarning, match=f"has no {MANIFEST}.*not verified.*export it again"):
        again = _load(tmp_path, model)
    assert torch.equal(again.fc.weight, model.fc.weight)
    heard: list[str] = []
    _load(tmp_path, model, warn=heard.append)
    assert len(heard) == 1 and str(tmp_path) in heard[0]
    _load(tmp_path, model, verify=False, warn=heard.append)  # the caller verified: said once, not twice
    assert len(heard) == 1


def test_a_damaged_header_without_a_manifest_is_one_line(tmp_path) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    (tmp_path / MANIFEST).unlink()
    _damage_header(tmp_path)
    with pytest.raises(ExportError) as info:
        _load(tmp_path, model, warn=lambda note: None)
    message = str(info.value)
    assert f"{tmp_path / WEIGHTS_NAME} is not a readable safetensors file" in message
    assert "\n" not in message and "dflash-pipe export RUN_DIR" in message
    with pytest.raises(ExportError, match="not a readable safetensors file"):  # also unverified by the caller
        _load(tmp_path, model, verify=False)


def test_an_unreadable_config_without_a_manifest_names_it(tmp_path) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    (tmp_path / MANIFEST).unlink()
    (tmp_path / CONFIG_NAME).write_text('{"hidden_size": ')
    with pytest.raises(ExportError, match=f"{CONFIG_NAME} is not valid JSON"):
        _load(tmp_path, model, warn=lambda note: None)


def test_a_missing_file_without_a_manifest_is_named(tmp_path) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    (tmp_path / MANIFEST).unlink()
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=f"no {WEIGHTS_NAME}"):
        _load(tmp_path, model)


def test_a_re_export_replaces_the_manifest(tmp_path) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    export_drafter(tiny_drafter(seed=1), tmp_path, dtype=torch.bfloat16)
    again = _load(tmp_path, model)
    assert again.fc.weight.dtype == torch.bfloat16


@pytest.fixture(params=[0o022, 0o027, 0o077], ids=lambda m: f"umask{m:03o}")
def umask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def test_export_files_have_the_mode_the_umask_says(tmp_path, umask) -> None:
    out = tmp_path / "out"
    export_drafter(tiny_drafter(), out)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    want = 0o666 & ~umask  # 0644 under 022, not the 0600 safetensors creates
    assert modes == {CONFIG_NAME: want, WEIGHTS_NAME: want, MODELING_NAME: want, MANIFEST: want}


def test_the_export_command_writes_a_verified_export_readable_by_others(tmp_path, umask) -> None:
    from click.testing import CliRunner

    from dflash_pipe.cli import main
    from dflash_pipe.run import checkpoint as ck

    model = tiny_drafter()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ck.save_checkpoint(
        tmp_path / "run", step=2, model=model, drafter_config=model.cfg.to_dict(), optimizer=opt, ledger={}
    )
    result = CliRunner().invoke(main, ["export", str(tmp_path / "run"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert sorted(json.loads((out / MANIFEST).read_text())["files"]) == [
        CONFIG_NAME,
        WEIGHTS_NAME,
        MODELING_NAME,
    ]
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o666 & ~umask}
    again = _load(out, model)
    assert torch.equal(again.fc.weight, model.fc.weight)
