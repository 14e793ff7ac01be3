"""Find the decoder-layer stack of any HF decoder-only model.

Feature capture hooks the decoder layers, so we need the ``nn.ModuleList`` holding them. HF models keep it
under different names (``model.layers`` for Llama/Qwen/Mistral, ``transformer.h`` for GPT-2,
``gpt_neox.layers``, ``model.decoder.layers`` for OPT, ``model.language_model.layers`` for VLM wrappers),
so we try the known paths first and fall back to the unique ``ModuleList`` of the right length.
"""

from __future__ import annotations

from torch import nn

# Dotted attribute paths, relative to the causal-LM model or to its decoder (``get_decoder()``).
KNOWN_LAYER_PATHS: tuple[str, ...] = (
    "model.layers",
    "layers",
    "model.language_model.layers",
    "language_model.layers",
    "model.decoder.layers",
    "decoder.layers",
    "transformer.h",
    "h",
    "gpt_neox.layers",
    "transformer.layers",
    "transformer.blocks",
    "model.transformer.layers",
)


def num_hidden_layers(config) -> int | None:
    """The decoder depth from an HF config (text sub-config for multimodal ones), or None if absent."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(text, name, None)
        if isinstance(value, int):
            return value
    return None


def _get_path(root: nn.Module, path: str) -> object | None:
    obj: object = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """Return the model's decoder layers, in forward order.

    Raises ``ValueError`` naming the model class when no plausible layer list exists (or several do), so
    an unsupported architecture fails at start-up instead of producing wrong features.
    """
    expected = num_hidden_layers(model.config) if hasattr(model, "config") else None
    roots: list[nn.Module] = [model]
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            decoder = get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            decoder = None
        if isinstance(decoder, nn.Module) and decoder is not model:
            roots.append(decoder)

    for root in roots:
        for path in KNOWN_LAYER_PATHS:
            found = _get_path(root, path)
            if isinstance(found, nn.ModuleList) and len(found) > 0 and (expected in (None, len(found))):
                return found

    # Fallback: the one ModuleList whose length is the configured depth.
    if expected is not None:
        candidates = {
            id(m): (name, m)
            for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) == expected
        }
        if len(candidates) == 1:
            return next(iter(candidates.values()))[1]
        names = sorted(name for name, _ in candidates.values())
        detail = (
            f"several ModuleLists have {expected} entries ({', '.join(names)})"
            if names
            else f"no ModuleList has num_hidden_layers={expected} entries"
        )
    else:
        detail = "its config has no num_hidden_layers"
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: none of the known paths "
        f"({', '.join(KNOWN_LAYER_PATHS)}) holds them and {detail}. Add the model's layer-list path to "
        "dflash_pipe.target.layers.KNOWN_LAYER_PATHS."
    )
