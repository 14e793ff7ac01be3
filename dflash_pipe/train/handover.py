"""What a newly formed group agrees on before it trains: one member's weights, optimizer, step and ledger.

After every rendezvous the most advanced member (highest step; lowest rank on a tie) broadcasts its state
to all. A worker that just joined thereby starts from the group's weights, not its own; after a member
died mid-step, a survivor that completed that step and one that did not end up identical again. No Python object
serialisation crosses the group: the ledger travels as JSON bytes in a uint8 tensor.
"""

from __future__ import annotations

import json

import torch

from dflash_pipe.run.ledger import Ledger
from dflash_pipe.train.distributed import DrafterGroup


def hand_over(
    group: DrafterGroup,
    *,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    step: int,
    ledger: Ledger,
) -> tuple[int, Ledger, int]:
    """Returns (step, ledger, source rank) as the group agreed; params and optimizer are updated in place."""
    has_state = int(all(p in optimizer.state for p in params))
    ledger_bytes = json.dumps(ledger.to_dict()).encode()
    table = group.all_gather_ints([step, has_state, len(ledger_bytes)])
    steps = table[:, 0].tolist()
    src = steps.index(max(steps))
    src_step, src_has_state, src_len = (int(x) for x in table[src].tolist())
    if src_has_state and not has_state:
        _materialize_optimizer_state(optimizer, params)
    tensors = [p.data for p in params]
    if src_has_state:
        for p in params:
            state = optimizer.state[p]
            tensors += [state[key] for key in sorted(state)]
    payload = torch.zeros(src_len, dtype=torch.uint8)
    if group.rank == src:
        payload = torch.frombuffer(bytearray(ledger_bytes), dtype=torch.uint8)
    group.broadcast([*tensors, payload], src)
    if group.rank != src:
        ledger = Ledger.from_dict(json.loads(payload.numpy().tobytes().decode()))
    return src_step, ledger, src


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """Lets the optimizer create its own state (same keys, dtypes, devices) with a step of zero gradients at
    lr 0, so the broadcast has tensors to fill. Weights do not move: lr 0 also disables weight decay."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=False)
