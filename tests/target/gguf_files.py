"""Tiny GGUF files for the tests, written with the ``gguf`` package's GGUFWriter (no download): a 2-layer
Llama over a byte-level vocabulary laid out like SmolLM2's (ids 0-2 ``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>``; ids 3-16 its unused code special tokens; a ChatML template with a default system prompt;
len(tokenizer) == vocab_size, so no free embedding row and no mask or reserved token)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
)
"""SmolLM2's ids 0-16, in its order."""
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MERGES = ("e r", "t h", "Ġ t", "i n", "a n", "o u", "Ġ a", "r e")
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
"""The tiny Llama's shape (head_dim 16)."""


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


def vocabulary() -> list[str]:
    """Every token of the tiny vocabulary, by id: the specials, the 256 bytes, then one token per merge."""
    return [*SPECIALS, *_byte_tokens(), *(m.replace(" ", "") for m in MERGES)]


def write_tiny_gguf(
    path: Path,
    *,
    architecture: str = "llama",
    quantize: bool = True,
    code_specials: bool = True,
    seed: int = 0,
) -> Path:
    """A tiny Llama GGUF at ``path``: the weight matrices as Q8_0 (``quantize``; else F32), the norms F32,
    tied embeddings (no ``output.weight``), rope theta 1e5. ``architecture``: what ``general.architecture``
    says (another name writes a file transformers refuses, the keys still llama's). ``code_specials``
    False: ids 3-16 are plain tokens, so the tokenizer has no token a MASK can be."""
    import gguf

    tokens = vocabulary()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-smollm-like")
    writer.add_vocab_size(vocab)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    control = len(SPECIALS) if code_specials else 3
    types = [gguf.TokenType.CONTROL] * control + [gguf.TokenType.NORMAL] * (vocab - control)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    def matrix(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
        if quantize:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    matrix("token_embd.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
