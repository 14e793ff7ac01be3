"""Regeneration's working sets on disk (``data.spill``, the regenerated file's ``DoneRecords``) give back
exactly what was put in, and a run's regeneration over them plans and trains what it does in memory."""

from __future__ import annotations

import threading

import numpy as np
import torch

from dflash_pipe.data.regenerated import Regenerated, RegenStore
from dflash_pipe.data.samples import Sample, sample_lengths
from dflash_pipe.data.spill import SpilledConversations, SpilledSamples


def _sample(i: int, n: int) -> Sample:
    g = torch.Generator().manual_seed(i)
    return Sample(i, torch.randint(0, 151_000, (n,), generator=g), torch.rand(n, generator=g) > 0.5)


def test_spilled_samples_read_back_what_was_set_and_none_elsewhere(tmp_path):
    spilled = SpilledSamples(tmp_path, 6)
    made = {4: _sample(4, 33), 1: _sample(1, 7), 5: _sample(5, 1)}  # out of order, as replies arrive
    for i, s in made.items():
        spilled[i] = s
    assert len(spilled) == 6 and [i for i, s in enumerate(spilled) if s is not None] == [1, 4, 5]
    for i, s in made.items():
        got = spilled[i]
        assert got is not None and got.sample_id == i
        assert torch.equal(got.input_ids, s.input_ids) and got.input_ids.dtype == torch.int64
        assert torch.equal(got.loss_mask, s.loss_mask) and got.loss_mask.dtype == torch.bool
    assert sample_lengths(spilled).tolist() == [0, 7, 0, 0, 33, 1]
    assert list(tmp_path.iterdir()) == []  # anonymous files: nothing is left in the run dir
    spilled.close()


def test_spilled_samples_are_read_while_others_are_written(tmp_path):
    spilled = SpilledSamples(tmp_path, 400)
    errors: list[str] = []

    def read() -> None:
        for _ in range(3):
            for i in range(400):
                s = spilled[i]
                if s is not None and not torch.equal(s.input_ids, _sample(i, 5 + i % 17).input_ids):
                    errors.append(f"sample {i}")

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(400):
        spilled[i] = _sample(i, 5 + i % 17)
    reader.join()
    assert errors == []


def test_spilled_conversations_keep_order_and_text(tmp_path):
    convs = SpilledConversations(tmp_path)
    items = [
        [{"role": "user", "content": f"q{i} é✓"}, {"role": "assistant", "content": "a" * i}]
        for i in range(50)
    ]
    for c in items:
        convs.append(c)
    assert len(convs) == 50 and convs[7] == items[7] and convs[-1] == items[-1] and list(convs) == items
    convs.append(items[0])  # appends after reads
    assert len(convs) == 51 and convs[50] == items[0]


def test_done_records_are_read_from_the_file_not_held(tmp_path):
    path = tmp_path / "regenerated.jsonl"
    store = RegenStore(path, {"target": {"name": "t"}})
    records = [
        Regenerated(
            index=i,
            turns=1,
            messages=[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"r{i}"}],
        )
        for i in (3, 0, 9)
    ]
    store.append(records[:2])
    store.append(records[2:])
    assert len(store.done) == 3 and sorted(store.done) == [0, 3, 9] and 5 not in store.done
    assert store.done[9].messages == records[2].messages
    store.close()
    again = RegenStore(path, {"target": {"name": "t"}})
    assert sorted(again.done) == [0, 3, 9] and again.done[3].messages == records[0].messages
    assert isinstance(again.done._start, np.ndarray)  # byte ranges, not records
    again.close()


def test_a_full_disk_is_one_line_naming_the_run_dir_and_the_files_stay_in_step(tmp_path, monkeypatch):
    import errno
    import os

    from dflash_pipe.diskspace import DiskFullError

    spilled = SpilledSamples(tmp_path, 3)
    spilled[0] = _sample(0, 9)
    real = os.pwrite
    calls = {"n": 0}

    def full(fd, data, offset):  # the mask write of the next sample finds the disk full
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    try:
        spilled[1] = _sample(1, 4)
    except DiskFullError as exc:
        text = str(exc)
    else:
        raise AssertionError("no DiskFullError")
    assert text.startswith(f"{tmp_path}: no space left for regeneration's working files") and "\n" not in text
    assert spilled[1] is None
    spilled[2] = _sample(2, 5)  # space again: it lands where the failed one would have
    assert torch.equal(spilled[2].loss_mask, _sample(2, 5).loss_mask)
    assert torch.equal(spilled[0].input_ids, _sample(0, 9).input_ids)
