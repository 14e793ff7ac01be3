"""The greedy decodings an evaluation compares against, kept on disk for the next evaluation of the same prompts.

Each held-out prompt is decoded greedily twice before any drafter runs: by HF ``generate`` (the lossless
check's reference, slow: Python at every layer and token) and on the verify stack (the speedup's baseline).
On a lent GPU the real-model bench evaluates in several calls (our drafters, the peer's, the graphed
drafting): stored here, the second call does not pay them again. An entry is reused only for the same
prompt tokens under the same settings (target, dtype, device, new tokens, stop tokens); anything else is
decoded afresh and the file rewritten.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from dflash_pipe.drafter.generate_eval import Reference
from dflash_pipe.drafter.speculate import GreedyOutput


def load_references(
    path: Path, settings: Mapping[str, Any], prompts: Mapping[str, list[Tensor]]
) -> dict[str, dict[int, Reference]]:
    """Per prompt set, the stored references whose settings and prompt tokens match (the others absent)."""
    out: dict[str, dict[int, Reference]] = {name: {} for name in prompts}
    if not path.is_file():
        return out
    stored = json.loads(path.read_text())
    if stored.get("settings") != _plain(settings):
        return out
    for name, set_prompts in prompts.items():
        for index, entry in stored.get("sets", {}).get(name, {}).items():
            i = int(index)
            if i < len(set_prompts) and entry["prompt"] == set_prompts[i].tolist():
                out[name][i] = Reference(
                    greedy=GreedyOutput(entry["greedy"], entry["greedy_s"]),
                    baseline=GreedyOutput(entry["baseline"], entry["baseline_s"]),
                )
    return out


def save_references(
    path: Path,
    settings: Mapping[str, Any],
    prompts: Mapping[str, list[Tensor]],
    references: Mapping[str, Mapping[int, Reference]],
) -> None:
    """Writes every reference held (atomically: a call cut mid-write leaves the previous file)."""
    sets = {
        name: {
            str(i): {
                "prompt": prompts[name][i].tolist(),
                "greedy": ref.greedy.tokens,
                "greedy_s": ref.greedy.seconds,
                "baseline": ref.baseline.tokens,
                "baseline_s": ref.baseline.seconds,
            }
            for i, ref in sorted(refs.items())
        }
        for name, refs in references.items()
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"settings": _plain(settings), "sets": sets}))
    tmp.replace(path)


def _plain(settings: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(settings), default=str))
