"""Target: the frozen LLM that produces the drafter's context features.

Public API:

- ``TargetCore(model_path, layer_ids, device, dtype)``: loads an HF causal LM and returns, for a packed
  batch, the concatenated outputs of the selected decoder layers ``[T, k*H]`` (no LM head). Hybrid targets
  (linear attention + full attention) stay exact on packed rows: their linear-attention layers get the
  sample boundaries (``target.hybrid``; flash-linear-attention's varlen kernels on CUDA). Which class loads
  a family, which attention it runs and whether its rows are packed or padded, and the probe that refuses a
  non-causal target: ``target.families`` (docs/targets.md has the table).
- ``build_demo_target(out_dir)``: materialise the embedded default target (tiny Qwen3 built from a config,
  briefly trained on the bundled sample data so its greedy predictions mean something) plus its tokenizer;
  cached by fingerprint. ``DemoRecipe`` (training knobs), ``default_cache_dir()`` (where it is cached).
- ``find_decoder_layers(model)``: the decoder-layer ``ModuleList`` of any HF decoder-only model.
"""

from __future__ import annotations

from dflash_pipe import lazy_exports

# Names load on first use (PEP 562): importing one submodule never runs the others (no cycle through
# this file), and ``from dflash_pipe.target import Name`` works as with eager imports.
_FROM = {
    ".core": ("TargetCore",),
    ".demo": ("DemoRecipe", "build_demo_target", "default_cache_dir"),
    ".layers": ("find_decoder_layers",),
}
_EXPORTS = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
