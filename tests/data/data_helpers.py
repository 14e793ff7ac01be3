"""Helpers shared by the data tests (a uniquely named module: other test packages have a conftest too)."""

from __future__ import annotations


def conv(*pairs: tuple[str, str], system: str | None = None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    for q, a in pairs:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def trained_runs(ids: list[int], mask) -> list[list[int]]:
    """The maximal runs of trained token ids, in order."""
    runs: list[list[int]] = []
    prev = False
    for t, m in zip(ids, [bool(x) for x in mask], strict=True):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(int(t))
        prev = m
    return runs


class SlowVocab:
    """A stand-in tokenizer for pre-tokenized data whose ``len()`` (taken once per piece) sleeps, so a pool's
    pieces take a while; picklable, for the spawned workers."""

    def __init__(self, seconds: float, size: int = 10_000) -> None:
        self.seconds = seconds
        self.size = size

    def __len__(self) -> int:
        import time

        time.sleep(self.seconds)
        return self.size


class DyingVocab:
    """A stand-in tokenizer whose ``len()`` ends the process it runs in, if that is a worker process."""

    def __len__(self) -> int:
        import multiprocessing
        import os

        if multiprocessing.parent_process() is None:
            raise RuntimeError("DyingVocab is only for pool workers")
        os._exit(3)
