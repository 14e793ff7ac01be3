"""The dashboard's balance hint: when the drafters of a node wait for batches (or its target idles) over
10% of the time, the split of the same GPUs that would keep both busy, from the run's own rates."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from test_core import _core, _hello

from dflash_pipe.producer.balance import balance_hint
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.wire import messages as m


def _running(tmp_path: Path, *, target_gpus: tuple[int, ...], drafters: int, produced: float, trained: float):
    core, _, _ = _core(tmp_path)
    layout = LayoutConfig(device="cuda", target_gpus=target_gpus, drafter_gpus=tuple(range(8 - drafters, 8)))
    core.cfg = dataclasses.replace(core.cfg, layout=layout)
    for i in range(drafters):
        core.handle(f"w{i}".encode(), _hello(f"w{i}"))
        core.handle(f"w{i}".encode(), m.Ready(credits=1))
    now = time.monotonic()
    for meter, rate in ((core.account.target_rate, produced), (core.account.train_rate, trained)):
        meter.add(0.0, now - 5.0)
        meter.add(rate * 5.0, now)
    core.account.first_ack = (now - 5.0, 0)
    return core


def test_starved_drafters_ask_for_more_target_gpus(tmp_path: Path) -> None:
    # 2 target GPUs at 10k tokens/s each feed 6 drafters that could take 30k/s each (busy half the time)
    core = _running(tmp_path, target_gpus=(0, 1), drafters=6, produced=20_000.0, trained=20_000.0)
    for t in range(10):  # the workers held credits the producer could not fill half of the time
        core.account.waits.observe(
            100.0 + t, target_idle=0.0, workers_starved=0.5 if t % 2 else 0.0, queue_depth=0
        )
    starved = core.account.waits.mean("workers_starved")
    line, split = balance_hint(core)  # type: ignore[misc]
    demand = 20_000.0 / (6 * (1 - starved))  # each drafter's rate over the time it was busy
    # the best split of 8 at 10k supply and `demand` per GPU, as run.split computes it
    best = max(range(1, 8), key=lambda t: (min(t * 10_000.0, (8 - t) * demand), -t))
    assert split.target == best > 2 and "drafters waited for batches" in line and "attach a producer" in line


def test_a_busy_node_and_a_node_with_producers_attached_get_no_hint(tmp_path: Path) -> None:
    core = _running(tmp_path, target_gpus=(0, 1), drafters=6, produced=20_000.0, trained=20_000.0)
    for t in range(10):
        core.account.waits.observe(100.0 + t, target_idle=0.05, workers_starved=0.05, queue_depth=1)
    assert balance_hint(core) is None
    for t in range(10, 20):
        core.account.waits.observe(100.0 + t, target_idle=0.0, workers_starved=1.0, queue_depth=0)
    assert balance_hint(core) is not None
    core.handle(b"p", _hello("node1", role="producer", host_id="other"))
    assert balance_hint(core) is None  # its workers are not counted here
