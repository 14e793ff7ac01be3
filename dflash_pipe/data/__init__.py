"""Data: JSONL/ShareGPT/pre-tokenized loading (JSONL files, or parquet/arrow/``datasets`` tables read in
record batches: ``sources.py``), chat-template rendering, token-budget batching.

Public API (the rest of the package imports only these names):

- ``DataConfig``: where the data is and how to cut it (path, max_length, token_budget, skip_bad_lines).
- ``Sample``: one tokenized sequence with its stable ``sample_id`` and ``loss_mask``.
- ``load_samples(cfg, tokenizer, store=None) -> LoadedData``: read and tokenize the data (big data in a pool
  of worker processes, same result); bad lines (rows) raise ``DataError`` naming file, line (row) and reason
  (or are skipped and counted with ``skip_bad_lines``). With ``store`` (a folder, a run's ``RunDir.samples``)
  the samples are kept on disk, memory-mapped, and reused by the next load of the same data and settings.
- ``DataFuture(cfg, tokenizer, store=None)``: the same load in a background thread; ``result()`` waits,
  ``close()`` stops.
- ``sample_lengths(samples)``: token count per sample (a store's from its offsets, no sample read).
- ``plan_batches(lengths, token_budget, *, seed, epoch, exclude) -> list[list[int]]``: the epoch's
  batches as lists of sample ids, shuffled deterministically by (seed, epoch), skipping ``exclude``.
- ``demo_tokenizer()`` / ``demo_data_path()``: the bundled tokenizer and sample dataset of the embedded demo.
"""

from __future__ import annotations

from dflash_pipe import lazy_exports

# Names load on first use (PEP 562): importing one submodule never runs the others (no cycle through
# this file), and ``from dflash_pipe.data import Name`` works as with eager imports.
_FROM = {
    ".batching": ("plan_batches",),
    ".config": ("DataConfig",),
    ".demo": ("demo_data_path", "demo_tokenizer"),
    ".loader": ("DataFuture", "load_samples"),
    ".samples": ("DataError", "LoadedData", "Sample", "sample_lengths"),
    ".store": ("StoredSamples",),
}
_EXPORTS = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
