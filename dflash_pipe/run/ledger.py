"""Per-epoch record of which samples were trained: the run's data cursor.

Every rank holds the same ledger (sample ids are all-gathered each step), so any rank's checkpoint is a
consistent pair of (weights, samples those weights have seen). A bitmap per epoch keeps it compact.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable

import numpy as np


class Ledger:
    def __init__(self, num_samples: int, epochs: int) -> None:
        if num_samples < 1:
            raise ValueError(f"Ledger needs at least one sample, got {num_samples}.")
        self.num_samples = num_samples
        self.epochs = epochs
        self._bits: dict[int, np.ndarray] = {}
        self.duplicates = 0
        """Samples trained a second time in the same epoch (only after a worker fault)."""

    def _epoch_bits(self, epoch: int) -> np.ndarray:
        if not 0 <= epoch < self.epochs:
            raise ValueError(f"epoch {epoch} is outside the run's {self.epochs} epochs.")
        bits = self._bits.get(epoch)
        if bits is None:
            bits = self._bits[epoch] = np.zeros(self.num_samples, dtype=bool)
        return bits

    def mark(self, epoch: int, sample_ids: Iterable[int]) -> None:
        ids = np.fromiter(sample_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise ValueError(f"sample id out of range [0, {self.num_samples}) in epoch {epoch}.")
        bits = self._epoch_bits(epoch)
        self.duplicates += int(bits[ids].sum())
        bits[ids] = True

    def trained(self, epoch: int) -> set[int]:
        bits = self._bits.get(epoch)
        return set() if bits is None else set(np.flatnonzero(bits).tolist())

    def count(self, epoch: int) -> int:
        bits = self._bits.get(epoch)
        return 0 if bits is None else int(bits.sum())

    def complete(self, epoch: int) -> bool:
        return self.count(epoch) == self.num_samples

    def total_trained(self) -> int:
        return sum(int(b.sum()) for b in self._bits.values())

    def progress(self) -> float:
        """Fraction of all planned sample visits done; drives the LR schedule."""
        return self.total_trained() / (self.num_samples * self.epochs)

    def current_epoch(self) -> int:
        """First epoch not yet complete (== epochs when training is finished)."""
        for epoch in range(self.epochs):
            if not self.complete(epoch):
                return epoch
        return self.epochs

    def with_epochs(self, epochs: int) -> Ledger:
        """The same record for a run of ``epochs`` epochs: a resume with more epochs trains on, with fewer
        it may drop only epochs nothing was trained in yet."""
        if epochs < 1:
            raise ValueError(f"a run needs at least one epoch, got {epochs}.")
        dropped = {e: int(b.sum()) for e, b in self._bits.items() if e >= epochs and b.any()}
        if dropped:
            first = min(dropped)
            raise ValueError(
                f"epochs {epochs}: the checkpoint has already trained {dropped[first]} sample(s) of epoch "
                f"{first + 1}; give {first + 1} or more epochs."
            )
        ledger = Ledger(self.num_samples, epochs)
        ledger.duplicates = self.duplicates
        ledger._bits = {e: b.copy() for e, b in self._bits.items() if e < epochs}
        return ledger

    def to_dict(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "epochs": self.epochs,
            "duplicates": self.duplicates,
            "bitmaps": {
                str(e): base64.b64encode(np.packbits(b).tobytes()).decode("ascii")
                for e, b in self._bits.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict) -> Ledger:
        ledger = cls(int(data["num_samples"]), int(data["epochs"]))
        ledger.duplicates = int(data.get("duplicates", 0))
        for epoch, encoded in data["bitmaps"].items():
            packed = np.frombuffer(base64.b64decode(encoded), dtype=np.uint8)
            ledger._bits[int(epoch)] = np.unpackbits(packed)[: ledger.num_samples].astype(bool)
        return ledger
