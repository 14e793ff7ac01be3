"""Train a tiny drafter, in seconds, on its target's own greedy continuations: the test that a measured tau
can tell a trained drafter from an untrained one (a tau only inside [1, block_size] proves nothing)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dflash_pipe.drafter import DFlashDrafter
from dflash_pipe.drafter.speculate import context_features, greedy_generate


@torch.no_grad()
def greedy_rows(
    target: nn.Module, prompts: Sequence[torch.Tensor], layer_ids: Sequence[int], new_tokens: int
):
    """Per prompt: (ids [S], target features [S, k*H], loss mask [S] over the greedy continuation)."""
    rows = []
    for prompt in prompts:
        new = greedy_generate(target, prompt, max_new_tokens=new_tokens).tokens
        ids = torch.cat([prompt.long(), torch.tensor(new, dtype=torch.long)])
        hidden = target(input_ids=ids[None], output_hidden_states=True).hidden_states
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[prompt.numel() :] = True
        rows.append((ids, context_features(hidden, layer_ids)[0].float(), mask))
    return rows


def train_on_greedy(
    target: nn.Module,
    drafter: DFlashDrafter,
    prompts: Sequence[torch.Tensor],
    *,
    new_tokens: int,
    steps: int = 40,
    lr: float = 1e-2,
    seed: int = 0,
) -> list[float]:
    """AdamW steps of ``drafter`` (in place; the target's embedding and head stay frozen) on the target's
    greedy continuation of every prompt, one row per prompt; the losses of each step, first to last."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is many times faster on a shared 2-core machine
    try:
        rows = greedy_rows(target, prompts, drafter.cfg.target_layer_ids, new_tokens)
        opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed)
        drafter.train()
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for ids, feats, mask in rows:
                loss = drafter(ids[None], feats[None], mask[None], generator=gen).loss / len(rows)
                loss.backward()
                total += float(loss.detach())
            opt.step()
            losses.append(total)
    finally:
        torch.set_num_threads(threads)
    drafter.eval()
    return losses
