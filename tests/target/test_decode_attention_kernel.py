"""The Triton decode-attention kernel against attention written out per slot and head.

Runs on CUDA; on a machine without one, under Triton's interpreter when triton is installed (it is not
on CPU CI, where the test is skipped: the kernel only ever runs on GPUs)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dflash_pipe.target.decode import attention_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, keys, values, lengths, scale, slots):
    """Softmax attention of each row's query heads over the first ``lengths[s]`` columns of its cache row
    ``slots[s]``, in fp32."""
    rows, heads, dim = q.shape
    groups = heads // keys.shape[1]
    out = torch.zeros(rows, heads, dim, device=q.device)
    for s in range(rows):
        n, c = int(lengths[s]), int(slots[s])
        k = keys[c, :, :n].float().repeat_interleave(groups, 0)  # [heads, n, D]
        v = values[c, :, :n].float().repeat_interleave(groups, 0)
        p = torch.softmax((q[s].float()[:, None] * k).sum(-1) * scale, dim=-1)
        out[s] = (p[..., None] * v).sum(1)
    return out


@pytest.mark.parametrize(
    ("slots", "heads", "kv_heads", "dim", "span", "lengths", "rows_of"),
    [
        (3, 4, 2, 16, 192, [1, 70, 192], None),  # split along the columns (few programs), an empty split
        (2, 8, 2, 32, 128, [128, 5], None),  # groups of 4
        (5, 2, 2, 16, 64, [64, 1, 33, 2, 64], None),  # no groups, one split
        (3, 4, 2, 16, 128, [40, 41, 42, 43, 7], [2, 2, 2, 2, 0]),  # a block of 4 rows on slot 2 (verify)
    ],
)
@pytest.mark.parametrize(
    "config",
    [
        None,  # config_for(rows)
        attention_kernel.KernelConfig(splits=1),  # the attention written directly, no combine
        attention_kernel.KernelConfig(block=32, splits=3, stages=3),
    ],
    ids=["default", "one-split", "three-splits-of-32"],
)
def test_kernel_equals_attention_over_each_slots_live_columns(
    slots, heads, kv_heads, dim, span, lengths, rows_of, config
):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    rows = len(lengths)
    q = torch.randn(rows, heads, dim, device=DEVICE).to(dtype)
    keys = torch.randn(slots, kv_heads, span + 9, dim, device=DEVICE).to(dtype)
    values = torch.randn(slots, kv_heads, span + 9, dim, device=DEVICE).to(dtype)
    keys[:, :, span:] = 1e4  # columns past the span: never read
    lengths_t = torch.tensor(lengths, device=DEVICE)
    slot_of = torch.tensor(rows_of or list(range(rows)), device=DEVICE)
    out, lse = attention_kernel.decode_attention(
        q, keys, values, lengths_t, span, dim**-0.5, slot_of, config=config
    )
    splits = (config and config.splits) or attention_kernel.splits_for(rows, kv_heads, span)
    if splits == 1:
        assert lse is None and out.shape == (rows, heads * dim) and out.dtype == dtype
    else:
        assert out.shape[2] == splits and lse is not None
    got = attention_kernel.combine(out, lse, heads // kv_heads, torch.float32).view(rows, heads, dim)
    want = _reference(q, keys, values, lengths_t, dim**-0.5, slot_of)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "span", "positions"),
    [
        (4, 2, 192, [0, 69, 191]),  # split along the columns: two rows' new column is past split 0's
        (8, 2, 128, [127, 4]),
    ],
)
def test_kernel_writes_each_rows_key_and_value_and_attends_to_them(heads, kv_heads, span, positions):
    """Decode mode: each row's new key and value land at its position in its own cache row (an idle row
    at the trash column, which nothing reads), and the row attends to them although that column held
    garbage when the call began (another split of the row may read it before split 0 stores it)."""
    torch.manual_seed(1)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    dim, trash = 16, span + 8
    rows = len(positions) + 1  # the last row is idle
    q = torch.randn(rows, heads, dim, device=DEVICE).to(dtype)
    keys = torch.randn(rows, kv_heads, trash + 1, dim, device=DEVICE).to(dtype)
    values = torch.randn(rows, kv_heads, trash + 1, dim, device=DEVICE).to(dtype)
    new_k = torch.randn(rows, kv_heads, dim, device=DEVICE).to(dtype)
    new_v = torch.randn(rows, kv_heads, dim, device=DEVICE).to(dtype)
    where = torch.tensor(positions + [trash], device=DEVICE)
    lengths = torch.tensor([p + 1 for p in positions] + [1], device=DEVICE)
    expected_k, expected_v = keys.clone(), values.clone()
    for r in range(rows):
        expected_k[r, :, where[r]] = new_k[r]
        expected_v[r, :, where[r]] = new_v[r]
    for r, p in enumerate(positions):
        keys[r, :, p], values[r, :, p] = 1e3, -1e3  # garbage until the kernel writes it
    slot_of = torch.arange(rows, device=DEVICE)
    out, lse = attention_kernel.decode_attention(
        q, keys, values, lengths, span, dim**-0.5, slot_of, write=(new_k, new_v, where)
    )
    torch.testing.assert_close(keys, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(values, expected_v, rtol=0, atol=0)
    got = attention_kernel.combine(out, lse, heads // kv_heads, torch.float32).view(rows, heads, dim)
    want = _reference(q, expected_k, expected_v, lengths, dim**-0.5, slot_of)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the slot stack takes the kernel on CUDA only")
@torch.inference_mode()
def test_stack_steps_on_the_kernel_equal_sdpa_steps():
    """A bf16 model on the GPU: a prefill then greedy steps with the kernel, against the same with SDPA
    over the span (the kernel reads fewer columns; the masked ones count for nothing in either)."""
    from transformers import AutoModelForCausalLM

    from dflash_pipe.target.decode import DecodeStack
    from tests.tiny_models import tiny_qwen3_config

    torch.manual_seed(0)
    config = tiny_qwen3_config(head_dim=32, hidden_size=64, vocab_size=128, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    outs = {}
    for kind in ("triton", "sdpa"):
        stack = DecodeStack(model, 256, decode_attention=kind)
        cache = stack.new_cache(4)
        prompts = [list(range(3, 3 + n)) for n in (40, 7, 100)]
        first = stack.prefill(cache, [0, 1, 2], prompts, [0, 0, 0]).argmax(-1)
        tokens = torch.cat([first, first.new_zeros(1)])
        positions = torch.tensor([40, 7, 100, cache.trash], device="cuda")  # slot 3 idle
        logits = []
        for _ in range(5):
            step = stack.step(cache, tokens, positions, 128)
            logits.append(step[:3])
            tokens = step.argmax(-1)
            positions = torch.where(positions == cache.trash, positions, positions + 1)
        outs[kind] = torch.stack(logits)
    torch.testing.assert_close(outs["triton"], outs["sdpa"], rtol=3e-2, atol=3e-2)
