"""The peer's rows written ahead (``bench/peers/specforge_dflash.py --rows-only``): the same rows dflash-pipe
trains on, written without SpecForge, so a device call before the peer's timed run can prepare them."""

import json
import subprocess
import sys
from pathlib import Path

from dflash_pipe.data import DataConfig, demo_data_path, demo_tokenizer, load_samples

ROOT = Path(__file__).resolve().parents[2]


def peer(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/peers/specforge_dflash.py", *args, "--minutes", "1", "--mask-token-id", "3"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_rows_only_writes_the_rows_dflash_pipe_trains_on(tmp_path):
    tok = demo_tokenizer()
    tok.save_pretrained(tmp_path / "target")
    rows = tmp_path / "rows.jsonl"
    done = peer("--target", str(tmp_path / "target"), "--conversations", str(demo_data_path()),
                "--rows", str(rows), "--out", str(tmp_path / "out"), "--rows-only", "--max-length", "512")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    want = load_samples(DataConfig(path=demo_data_path(), max_length=512), tok).samples
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    assert len(got) == len(want) > 0
    assert got[0]["input_ids"] == want[0].input_ids.tolist()
    assert got[0]["loss_mask"] == [int(x) for x in want[0].loss_mask.tolist()]
    assert "wrote" in done.stdout and not (tmp_path / "out" / "features").exists()  # no capture, no training


def test_rows_only_needs_conversations(tmp_path):
    done = peer("--target", str(tmp_path), "--rows", str(tmp_path / "r.jsonl"), "--out", str(tmp_path),
                "--rows-only")  # fmt: skip
    assert done.returncode == 2 and "give --conversations" in done.stderr
