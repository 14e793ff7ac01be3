from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_pipe.data import demo_tokenizer


@pytest.fixture(scope="session")
def tok():
    return demo_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path: Path):
    """write_jsonl(rows) -> Path; a row that is a str is written verbatim (for bad lines)."""

    def write(rows: list, name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    return write
