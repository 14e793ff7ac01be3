"""The peer's rows written ahead (``bench/peers/specforge_dflash.py --rows-only``): the same rows dflash-pipe
trains on, written without SpecForge, so a device call before the peer's timed run can prepare them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipe.data import DataConfig, demo_data_path, demo_tokenizer, load_samples

ROOT = Path(__file__).resolve().parents[2]


def peer(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/peers/specforge_dflash.py", *args, "--minutes", "1", "--mask-token-id", "3"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
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


def test_rows_of_a_regenerated_file_are_the_target_ids_the_run_trained(tmp_path):
    """A regenerated line that keeps the target's ids gives those ids (not its text tokenized again, which
    differs here); a line without them gives its rendered text, as the producer's samples do."""
    from dflash_pipe.bench.peer_common import write_rows
    from dflash_pipe.data.config import RegenConfig
    from dflash_pipe.data.regenerated import Regenerated, RegenStore, provenance
    from dflash_pipe.data.render import render_conversation, render_prompt
    from dflash_pipe.data.token_form import TokenForm

    tok = demo_tokenizer()
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    data = DataConfig(path=demo_data_path(), max_length=512)
    store = RegenStore(tmp_path / "regenerated.jsonl", provenance(tmp_path / "target", data, RegenConfig()))
    asked = [{"role": "user", "content": "Name a pet."}]
    prompt = tok(render_prompt(tok, asked, {}), add_special_tokens=False)["input_ids"]
    letters = [tok.convert_tokens_to_ids(c) for c in "cat"]  # the text "cat" tokenizes otherwise
    end = tok.convert_tokens_to_ids("<|im_end|>")
    form = TokenForm().extended(prompt, letters, end)
    said = [*asked, {"role": "assistant", "content": "cat"}]
    plain = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "red, or blue"}]
    store.append([Regenerated(index=0, messages=said, turns=1, tokens=form),
                  Regenerated(index=1, messages=plain, turns=1)])  # fmt: skip
    store.close()
    rows = tmp_path / "rows.jsonl"
    assert write_rows(tmp_path / "regenerated.jsonl", tok, rows, max_length=512, limit=None) == 2
    first, second = (json.loads(line) for line in rows.read_text().splitlines())
    assert (
        first["input_ids"] == prompt + letters + [end] != render_conversation(tok, said)[0][: len(form.ids)]
    )
    assert first["loss_mask"] == [0] * len(prompt) + [1] * 4
    ids, mask = render_conversation(tok, plain)
    assert second["input_ids"] == ids and second["loss_mask"] == [int(m) for m in mask]
