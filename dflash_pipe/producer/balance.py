"""The split that would balance a running node: when its drafters wait for batches (or its target idles)
more than ``IDLE_HINT`` of the time, the dashboard says which split of the same GPUs would keep both busy,
for the next launch or for the producers and workers to attach.

The per-GPU rates come from the run itself: the busy side's rate per GPU as measured, the idle side's as
measured over the share of the time it was busy (``run.split`` does the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_pipe.run.split import Split, splits

if TYPE_CHECKING:
    from dflash_pipe.producer.core import ProducerCore

IDLE_HINT = 0.10
"""Issue 31: a side idle more than this share of the time gets a hint."""


def balance_hint(core: ProducerCore) -> tuple[str, Split] | None:
    """(the dashboard's line, the balanced split), or None while both sides are busy, before the first
    ACK, on CPU or shared GPUs, or with producers attached (their workers are not counted here)."""
    layout = core.cfg.layout
    if layout.device != "cuda" or layout.shared_gpus() or core.account.first_ack is None:
        return None
    if any(p.role == "producer" for p in core.peers.live()):
        return None
    drafters = sum(p.role == "worker" and p.state == "training" for p in core.peers.live())
    targets = len(layout.target_gpus)
    trained, produced = core.account.train_rate.rate(), core.account.target_rate.rate()
    if drafters == 0 or trained <= 0 or produced <= 0:
        return None
    starved, idle = core.account.waits.mean("workers_starved"), core.account.waits.mean("target_idle")
    if starved > IDLE_HINT:
        supply, demand = produced / targets, trained / (drafters * (1 - starved))
        why = f"the drafters waited for batches {starved:.0%} of the time"
    elif idle > IDLE_HINT:
        supply, demand = produced / (targets * (1 - idle)), trained / drafters
        why = f"the target idled {idle:.0%} of the time"
    else:
        return None
    best = splits(targets + drafters, supply, demand)[0]
    if best.target == targets:
        return None
    line = (
        f"balance: {why}; {best.target} target + {best.drafters} drafter GPU(s) would train about "
        f"{best.predicted:.0f} tokens/s (now {trained:.0f}): launch so next time, or attach "
        f"{'a producer' if best.target > targets else 'workers'} now"
    )
    return line, best
