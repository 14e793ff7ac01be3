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

from dflash_pipe.target.core import TargetCore
from dflash_pipe.target.demo import DemoRecipe, build_demo_target, default_cache_dir
from dflash_pipe.target.layers import find_decoder_layers

__all__ = ["DemoRecipe", "TargetCore", "build_demo_target", "default_cache_dir", "find_decoder_layers"]
