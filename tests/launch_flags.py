"""The sizes the end-to-end tests launch with: the smallest run that still shows what a test claims.

On two CPU cores a launch's steps cost what its drafter computes: the demo's default drafter (5 layers, 32
anchors of 16 slots on 512-token samples) takes about 1.9 s a step of 1,024 tokens, the one below about 0.3 s, and the
pipeline, the ledger, the handshakes and the faults are the same for both. A test that claims something of
the drafter's size (learning, the demo's defaults) says so and launches with those instead.
"""

from __future__ import annotations

from pathlib import Path

from dflash_pipe.data import demo_data_path

SMALL_DRAFTER = ("--draft-layers", "1", "--max-anchors", "8")
"""One draft layer, 8 blocks per sample: the drafter's compute, the largest part of a CPU step, cut ~4x."""

SMALL_BATCHES = ("--token-budget", "512", "--max-length", "128")
"""Short samples in small batches: more steps per epoch of the same samples, each cheaper."""

SMALL_RUN = (*SMALL_DRAFTER, *SMALL_BATCHES)

LEARNING_RUN = ("--max-anchors", "8", *SMALL_BATCHES)
"""For a test that claims learning: the demo's own depth (3 layers) with 8 blocks per sample, in small batches.
One layer learns too little in 40 steps (real tau 1.10-1.16 on held-out demo prompts, 1.26-1.28 at 2 layers,
1.33-1.41 at 3; untrained 1.0), and at these sizes the depth costs little: a step is ~1 s of the three
processes' CPU either way, start-up and regeneration being most of a launch."""


def demo_subset(path: Path, n: int) -> Path:
    """The first ``n`` conversations of the bundled demo data, written to ``path``: a launch tokenizes its
    whole data before the first step (about 7 s for the demo's 3,000 on two cores)."""
    lines = demo_data_path().read_text().splitlines()[:n]
    path.write_text("\n".join(lines) + "\n")
    return path
