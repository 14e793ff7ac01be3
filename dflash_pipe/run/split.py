"""The arithmetic of splitting a node's GPUs between the target and the drafters.

Supply (trained tokens/s the target GPUs can feed) against demand (tokens/s the drafter GPUs can train):
every split of N GPUs trains min(t x supply per GPU, (N - t) x demand per GPU); on one device both sides
share it and each token costs target time plus drafter time. ``bench split`` measures the per-GPU rates
with a probe; the producer's dashboard estimates them from a running run (``producer.balance``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Split:
    target: int
    drafters: int
    supply: float
    """Trained tokens/s the target GPUs can feed."""
    demand: float
    """Tokens/s the drafter GPUs can train."""

    @property
    def predicted(self) -> float:
        return min(self.supply, self.demand)

    @property
    def label(self) -> str:
        return f"{self.target}+{self.drafters}"


def splits(gpus: int, per_target_gpu: float, per_drafter_gpu: float) -> list[Split]:
    """Every split of ``gpus`` (at least one GPU a side), best predicted first, fewer target GPUs first
    among equals."""
    if gpus < 2:
        raise ValueError(f"a split needs at least 2 GPUs, got {gpus} (on one GPU both sides share it)")
    every = [Split(t, gpus - t, t * per_target_gpu, (gpus - t) * per_drafter_gpu) for t in range(1, gpus)]
    return sorted(every, key=lambda s: (-s.predicted, s.target))


def neighbours(ranked: list[Split]) -> list[Split]:
    """The pick and the splits one GPU either side of it, in target-GPU order."""
    pick = ranked[0]
    return sorted((s for s in ranked if abs(s.target - pick.target) <= 1), key=lambda s: s.target)


def shared_device(per_target: float, per_drafter: float) -> dict[str, float]:
    """One device for both: each token costs its target time plus its drafter time."""
    cost_t, cost_d = 1 / per_target, 1 / per_drafter
    return {
        "target_share": cost_t / (cost_t + cost_d),
        "drafter_share": cost_d / (cost_t + cost_d),
        "predicted_tokens_per_s": 1 / (cost_t + cost_d),
    }


def supply_with_regeneration(feature_rate: float, decode_rate: float, generated_per_trained: float) -> float:
    """Trained tokens/s one replica supplies when it also writes the replies: every trained token costs a
    feature-forward token and ``generated_per_trained`` decoded tokens."""
    return 1.0 / (1.0 / feature_rate + generated_per_trained / decode_rate)
