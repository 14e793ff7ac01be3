"""What a run with attaching producers recorded, as JSON: the ledger of its last checkpoint (every sample
of every epoch trained once?), the bytes of each link, and the supply and trained tokens/s per phase (how
many producers fed the run). The summary is `dflash_pipe.bench.attach.summarize`.

    python bench/attached_producer_summary.py RUN_DIR [--producer NAME ...] > summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_pipe.bench.attach import summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--producer", action="append", help="An attached producer's name (default node1).")
    args = parser.parse_args()
    print(json.dumps(summarize(args.run_dir, args.producer or ["node1"]), indent=2))


if __name__ == "__main__":
    main()
