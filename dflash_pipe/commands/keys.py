"""``dflash-pipe keys``: the CURVE key pairs of a run on a non-loopback address."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_pipe.commands import console


@click.group()
def keys() -> None:
    """CURVE keys that authenticate workers to a producer on a non-loopback address."""


@keys.command("generate")
@click.argument("directory", type=click.Path(path_type=Path))
def keys_generate(directory: Path) -> None:
    """Write a server and a client key pair into DIRECTORY (files 0600, directory 0700).

    \b
    Then: dflash-pipe launch --bind tcp://0.0.0.0:5555 --keys DIRECTORY ...
          dflash-pipe worker --connect tcp://HOST:5555 --keys DIRECTORY ...
    Worker hosts need DIRECTORY/client.key_secret and DIRECTORY/server.key; only the producer host needs
    DIRECTORY/server.key_secret. See docs/security.md.
    """
    from dflash_pipe.wire.auth import KeyFileError, generate_keys

    try:
        files = generate_keys(directory)
    except (KeyFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    for path in files:
        console.print(f"wrote {path}")
