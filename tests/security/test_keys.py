"""`dflash-pipe keys generate DIR`: key files in the zmq.auth format, private modes, clear load errors."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq.auth
from click.testing import CliRunner

from dflash_pipe.cli import main
from dflash_pipe.wire.auth import KeyFileError, generate_keys, load_client_keys, load_server_keys


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generate_writes_private_key_pairs(tmp_path: Path):
    keys = tmp_path / "keys"
    files = generate_keys(keys)
    names = sorted(str(p.relative_to(keys)) for p in files)
    assert names == [
        "client.key",
        "client.key_secret",
        "clients/client.key",
        "server.key",
        "server.key_secret",
    ]
    assert all(mode(p) == 0o600 for p in files)
    assert mode(keys) == 0o700 and mode(keys / "clients") == 0o700
    server, client = load_server_keys(keys), load_client_keys(keys)
    assert client.server_public == server.public and client.public in server.allowed
    assert zmq.auth.load_certificate(keys / "server.key")[1] is None  # the public file holds no secret


def test_generate_refuses_to_overwrite(tmp_path: Path):
    generate_keys(tmp_path)
    with pytest.raises(KeyFileError, match="already exists; refusing to overwrite"):
        generate_keys(tmp_path)


def test_cli_keys_generate(tmp_path: Path):
    result = CliRunner().invoke(main, ["keys", "generate", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    assert mode(tmp_path / "k" / "server.key_secret") == 0o600
    again = CliRunner().invoke(main, ["keys", "generate", str(tmp_path / "k")])
    assert again.exit_code != 0 and "refusing to overwrite" in again.output


@pytest.mark.parametrize(
    "damage, load, match",
    [
        (lambda d: os.rename(d, d.with_name("gone")), load_server_keys, "no such directory.*keys generate"),
        (
            lambda d: (d / "server.key_secret").unlink(),
            load_server_keys,
            "no server.key_secret.*keys generate",
        ),
        (lambda d: (d / "server.key").unlink(), load_client_keys, "no server.key there"),
        (lambda d: (d / "client.key_secret").unlink(), load_client_keys, "no client.key_secret"),
        (lambda d: (d / "clients" / "client.key").unlink(), load_server_keys, "holds no \\*.key file"),
        (lambda d: os.chmod(d / "client.key_secret", 0o644), load_client_keys, "mode 0644.*chmod 600"),
        (lambda d: (d / "server.key_secret").write_text("hello\n"), load_server_keys, "not a readable zmq"),
        (
            lambda d: (d / "clients" / "x.key").write_text('public-key = "short"\n'),
            load_server_keys,
            "no valid public key",
        ),
    ],
)
def test_bad_key_directories_name_the_file_and_the_fix(tmp_path: Path, damage, load, match):
    keys = tmp_path / "keys"
    generate_keys(keys)
    damage(keys)
    with pytest.raises(KeyFileError, match=match):
        load(keys)
