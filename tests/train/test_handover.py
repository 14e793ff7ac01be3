"""Two gloo ranks form a group through the elastic rendezvous; the most advanced one hands its state over."""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dflash_pipe.run.ledger import Ledger
from dflash_pipe.train.distributed import DrafterGroup
from dflash_pipe.train.handover import hand_over


def _member(port: int, step: int, trained: list[int], out: mp.Queue) -> None:
    torch.manual_seed(step)  # different weights on each rank
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ledger = Ledger(10, 2)
    ledger.mark(0, trained)
    if step:  # the advanced rank has optimizer state; the newcomer has none
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    # Both members reach the rendezvous together: it closes LAST_CALL_S after its first arrival, and a
    # member still importing torch on a loaded machine would miss it (two groups of one).
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    store.add("test_members_arrived", 1)
    while store.add("test_members_arrived", 0) < 2:
        time.sleep(0.05)
    group = DrafterGroup(
        f"tcp://127.0.0.1:{port}", run_id="t", device=torch.device("cpu"), timeout_s=30, join_timeout_s=60
    )
    try:
        group.form()
        new_step, new_ledger, src = hand_over(
            group, params=list(model.parameters()), optimizer=optimizer, step=step, ledger=ledger
        )
        state = optimizer.state[model.weight]
        out.put(
            (
                new_step,
                sorted(new_ledger.trained(0)),
                src == group.rank if step else None,
                model.weight.detach().sum().item(),
                float(state["exp_avg"].abs().sum()),
                group.world_size,
            )
        )
    finally:
        group.close()


@pytest.mark.slow  # two spawned gloo members: ~20 s on 2 shared cores
def test_the_newcomer_gets_weights_optimizer_step_and_ledger():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_member, args=(store.port, step, ids, out))
        for step, ids in ((7, [1, 2, 3]), (0, []))
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(r[5] == 2 for r in results)
    assert [r[0] for r in results] == [7, 7]
    assert all(r[1] == [1, 2, 3] for r in results)
    assert results[0][3] == results[1][3] and results[0][4] == results[1][4] > 0
