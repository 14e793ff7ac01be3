"""Child processes of the benches: ``python -m dflash_pipe.bench.child KIND SPEC_JSON OUT_JSON``.

- ``drafter``: a drafter worker built as ``dflash-pipe worker`` builds it, training with the real loop
  (``run_training``: group vote, step, gradient all-reduce) on batch files instead of a producer.
- ``sink``: the receiving half of the wire: HELLO-less DEALER that sends READY, unpacks each BATCH onto its
  device as a worker does, and ACKs it.
- ``compile``: one worker start on a compile cache: build, warm up under the launcher's lock, first step.

Each writes its figures to OUT_JSON; the parent reads them. Started with the launcher's worker environment
(compile cache, thread bounds) set before torch is imported.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

MIN_MEASURED_STEPS = 3
"""Steps after the first that a timed drafter run trains at least, however short ``seconds`` is."""


def main(argv: list[str]) -> int:
    kind, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    run = {"drafter": run_drafter, "sink": run_sink, "compile": run_compile}.get(kind)
    if run is None:
        raise SystemExit(f"unknown bench child kind {kind!r}; expected drafter, sink or compile")
    result = run(spec)
    Path(out_path).write_text(json.dumps(result))
    return 0


class FileFeed:
    """Stands where the worker's ``ProducerLink`` stands: hands out BATCH messages read from safetensors
    files against the worker's credits, and records each ACK. ``seconds`` after the first ACK (or when
    the files run out, without ``cycle``) it answers DONE."""

    def __init__(self, files: list[str], spec: dict[str, Any], *, cycle: bool, synthetic: bool) -> None:
        import torch

        self.files = files
        self.cycle = cycle
        self.synthetic = synthetic
        self.seconds = spec["seconds"]
        self.feature_size = spec["feature_size"]
        self.dtype = getattr(torch, spec["feature_dtype"])
        self.credits = spec["credits"]
        self.next = 0
        self.tokens_of: dict[int, int] = {}
        self.first_ack: float | None = None
        self.first_get: float | None = None
        self.last_ack: float | None = None
        self.tokens_after_first = 0
        self.acks_after_first = 0
        self.tokens_total = 0
        self.done_sent = False
        self._features = None

    def get(self, timeout_s: float):
        from dflash_pipe.wire import messages as m

        if self.done_sent:
            time.sleep(min(timeout_s, 0.01))
            return None
        over = (
            self.first_ack is not None
            and self.seconds is not None
            and time.time() - self.first_ack >= self.seconds
            and self.acks_after_first >= MIN_MEASURED_STEPS
        )
        drained = not self.cycle and self.next >= len(self.files) and not self.tokens_of
        if over or drained:
            self.done_sent = True
            return m.Done(reason="bench finished")
        if self.credits <= 0 or (not self.cycle and self.next >= len(self.files)):
            time.sleep(min(timeout_s, 0.01))
            return None
        self.credits -= 1
        self.first_get = self.first_get or time.time()
        batch = self._load(self.next)
        self.next += 1
        return batch

    def _load(self, index: int):
        from safetensors.torch import load_file

        from dflash_pipe.wire import messages as m

        slot = index % len(self.files)
        t = load_file(self.files[slot])
        lengths = t["lengths"].tolist()
        if self.synthetic:  # one random buffer, sliced: the bench times training, not the generator
            t["features"] = self._random_features(sum(lengths))
        self.tokens_of[index] = sum(lengths)
        return m.Batch(
            batch_id=index,
            epoch=index // len(self.files),
            sample_ids=t["sample_ids"].tolist(),
            lengths=lengths,
            tensors={k: t[k] for k in ("input_ids", "loss_mask", "features")},
        )

    def _random_features(self, tokens: int):  # [tokens, k*H]
        import torch

        if self._features is None or self._features.shape[0] < tokens:
            gen = torch.Generator().manual_seed(tokens)
            self._features = torch.randn(tokens, self.feature_size, generator=gen).to(self.dtype)
        return self._features[:tokens]

    def send(self, msg: Any) -> None:
        from dflash_pipe.wire import messages as m

        if isinstance(msg, m.Ready):
            self.credits += msg.credits
        elif isinstance(msg, m.Ack):
            now = time.time()
            tokens = sum(self.tokens_of.pop(b) for b in msg.batch_ids)
            self.tokens_total += tokens
            if self.first_ack is None:
                self.first_ack = now
            else:
                self.tokens_after_first += tokens
                self.acks_after_first += 1
            self.last_ack = now

    def send_and_flush(self, msg: Any, timeout_s: float = 5.0) -> bool:
        self.send(msg)
        return True


def build_from_spec(spec: dict[str, Any], device: Any, *, compile_layers: bool = False):
    """(model, optimizer, train config, compiled?) as the worker builds them from WELCOME's fields
    (``train.build.build_drafter``). ``compile_layers`` also compiles each decoder layer (the compile bench
    on CPU, where the worker compiles nothing: flex attention has no CPU backward, so there is no compiled
    attention)."""

    from dflash_pipe.compute.precision import compute_dtype
    from dflash_pipe.config.train import TrainConfig
    from dflash_pipe.drafter import DrafterConfig, load_frozen_target_parts
    from dflash_pipe.train.build import build_drafter
    from dflash_pipe.train.optim import build_optimizer

    drafter_cfg = DrafterConfig.from_dict(spec["drafter"])
    train_cfg = TrainConfig.from_dict(spec["train"])
    dtype = compute_dtype(device)
    embed, head = load_frozen_target_parts(spec["target_path"], dtype=dtype, device=device)
    model, compiled = build_drafter(
        drafter_cfg, train_cfg, embed, head, device, compile_layers=True if compile_layers else None
    )
    optimizer = build_optimizer(model.trainable_parameters(), train_cfg)
    return model, optimizer, train_cfg, compiled


def warm(model: Any, spec: dict[str, Any], device: Any) -> dict[str, float]:
    """The worker's warm-up, as ``train.compile_warmup`` says: once (one process compiles under the cache's
    lock, the others then start warm) or each (every process compiles at once); with full, then checked."""
    from dflash_pipe.config.train import TrainConfig
    from dflash_pipe.drafter import DrafterConfig
    from dflash_pipe.train.compile_check import warm_up_checked

    cfg = DrafterConfig.from_dict(spec["drafter"])
    plan = TrainConfig.from_dict(spec["train"]).compile_plan(device.type)
    return warm_up_checked(
        model,
        full=plan == "full",
        drafter_config=spec["drafter"],
        cache_dir=Path(spec["cache_dir"]),
        device=device,
        seq_len=min(spec.get("warmup_seq_len", 1024), cfg.max_position_embeddings),
        batch_sizes=tuple(spec.get("warmup_batch_sizes", (2, 1))),
        once=spec["train"]["compile_warmup"] == "once",
    )


def run_drafter(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from dflash_pipe.drafter import DrafterConfig
    from dflash_pipe.run.ledger import Ledger
    from dflash_pipe.train.distributed import DrafterGroup
    from dflash_pipe.worker.loop import WorkerSession, regroup, run_training

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, optimizer, train_cfg, compiled = build_from_spec(spec, device)
    if compiled:
        warm(model, spec, device)
    feed = FileFeed(spec["files"], spec, cycle=spec["synthetic"], synthetic=spec["synthetic"])
    group = DrafterGroup(
        spec["rendezvous"], run_id=spec["run_id"], device=device, timeout_s=300, join_timeout_s=600
    )
    drafter_cfg = DrafterConfig.from_dict(spec["drafter"])
    session = WorkerSession(
        link=feed,  # type: ignore[arg-type] -- FileFeed has the link's get/send
        group=group,
        model=model,
        optimizer=optimizer,
        ledger=Ledger(spec["num_samples"], 10_000),
        train=train_cfg,
        drafter_config=spec["drafter"],
        run_dir=Path(spec["run_dir"]),
        device=device,
        block_size=drafter_cfg.block_size,
        feature_size=drafter_cfg.feature_size,
    )
    try:
        regroup(session, "bench")
        result = run_training(session, lambda: False)
    finally:
        group.close()
    if feed.first_ack is None:
        raise RuntimeError("the drafter trained no step; give the bench more --seconds or more data")
    return {
        "steps": result.steps,
        "first_get": feed.first_get,
        "first_ack": feed.first_ack,
        "last_ack": feed.last_ack,
        "tokens_after_first": feed.tokens_after_first,
        "tokens_total": feed.tokens_total,
    }


def run_sink(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from dflash_pipe.train.batches import unpack
    from dflash_pipe.wire import messages as m
    from dflash_pipe.wire.transport import WorkerEndpoint

    device = torch.device(spec["device"])
    endpoint = WorkerEndpoint(spec["address"])
    received = 0
    try:
        endpoint.send(m.Ready(credits=spec.get("credits", 2)))
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            msg = endpoint.recv(timeout_s=1.0)
            if isinstance(msg, m.Batch):
                batch = unpack(msg.tensors, msg.lengths, device, feature_size=spec["feature_size"])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                del batch
                received += 1
                endpoint.send(m.Ack(batch_ids=[msg.batch_id], step=received))
                endpoint.send(m.Ready(credits=1))
            elif isinstance(msg, m.Done):
                endpoint.send_final(m.Bye(reason="done"))
                return {"received": received}
        raise RuntimeError("the transport bench's sender sent no DONE within 900 s")
    finally:
        endpoint.close()


def run_compile(spec: dict[str, Any]) -> dict[str, Any]:
    """Time from process start to the end of the first real training step, as a launched worker."""
    import torch

    from dflash_pipe.compute.precision import autocast, compute_dtype

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, optimizer, _, _ = build_from_spec(spec, device, compile_layers=spec["compile_layers"])
    built = time.time()
    warm_info = warm(model, spec, device)
    warmed = time.time()
    k = len(spec["drafter"]["target_layer_ids"])
    gen = torch.Generator(device=device).manual_seed(1)
    # The warm-up's first shape: a warm worker's first real batch runs compiled code, not a recompile.
    shape = (spec.get("warmup_batch_sizes", [2])[0], spec["step_seq_len"])
    ids = torch.randint(0, spec["drafter"]["vocab_size"], shape, device=device, generator=gen)
    dtype = compute_dtype(device)
    feats = torch.randn(*shape, k * spec["drafter"]["hidden_size"], device=device, generator=gen).to(dtype)
    mask = torch.ones(*shape, dtype=torch.bool, device=device)
    with autocast(device):
        out = model(ids, feats, mask, generator=gen)
    out.loss_sum.backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done = time.time()
    return {
        "started": spec["started"],
        "first_step_s": done - spec["started"],
        "build_s": built - spec["started"],
        "warmup_s": warmed - built,
        "step_s": done - warmed,
        **warm_info,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
