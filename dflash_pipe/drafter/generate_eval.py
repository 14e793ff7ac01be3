"""Real acceptance of a drafter: speculative decoding of held-out prompts, checked against greedy decoding.

The prompts are the held-out conversations' turns before their first assistant turn (what the chat template
renders up to the assistant header); each answer runs to the end of its turn or ``max_new_tokens``. The
target's greedy decoding of each prompt by HF ``generate`` is the lossless reference; the same greedy decoding
on the stack speculative decoding verifies on (one token a step) is the speed baseline. The target is frozen,
so a run computes both once per prompt (``references``) and reuses them at every evaluation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import Tensor, nn

from dflash_pipe.compute.precision import autocast, compute_dtype

from .acceptance import AcceptanceCounts
from .evaluate import per_slot_table
from .graphed_draft import GraphedProposer, graphs_apply
from .model import DFlashDrafter
from .speculate import (
    GreedyOutput,
    LosslessError,
    SpecOutput,
    check_lossless,
    drafter_proposer,
    greedy_generate,
    speculative_generate,
    stack_greedy_generate,
)

METRIC_PREFIX = "real/"
"""metrics.jsonl keys of the real (speculative decoding) evaluation; the teacher-forced one is "simulated/"."""


@dataclass(slots=True)
class Reference:
    """A prompt's greedy decoding, twice."""

    greedy: GreedyOutput
    """By HF ``generate``: the independent reference speculative decoding must equal."""
    baseline: GreedyOutput
    """On the stack speculative decoding verifies on, one token a step: the speedup's baseline."""


@dataclass(slots=True)
class PromptResult:
    prompt_tokens: int
    spec: SpecOutput
    greedy: GreedyOutput | None
    """None when the lossless check was not asked for."""
    baseline: GreedyOutput | None = None

    @property
    def lossless(self) -> bool | None:
        return None if self.greedy is None else self.spec.tokens == self.greedy.tokens


@dataclass(slots=True)
class GenerateResult:
    """Real acceptance over prompts: tau as DFlash counts it (tokens per draft-verify step, bonus included,
    per prompt, then averaged over prompts), and pooled over every step with the per-position rates."""

    prompts: list[PromptResult]
    block_size: int

    @property
    def counts(self) -> AcceptanceCounts:
        total = AcceptanceCounts.zeros(self.block_size)
        for p in self.prompts:
            total = total + p.spec.counts
        return total

    @property
    def tau(self) -> float:
        """The DFlash reference benchmark's "average acceptance length": each prompt's tokens per step (the
        bonus included), averaged over the prompts that took a step."""
        taus = [p.spec.counts.tau for p in self.prompts if p.spec.counts.anchors]  # a prompt may end at once
        return sum(taus) / len(taus) if taus else self.counts.tau

    @property
    def tau_pooled(self) -> float:
        """Tokens per step over all steps of all prompts together: 1 + the per-position acceptance rates."""
        return self.counts.tau

    @property
    def new_tokens(self) -> int:
        return sum(len(p.spec.tokens) for p in self.prompts)

    @property
    def seconds(self) -> float:
        return sum(p.spec.seconds for p in self.prompts)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def greedy_tokens_per_s(self) -> float | None:
        """Greedy decoding's rate on the stack speculative decoding verifies on (the speedup's baseline)."""
        return _rate([p.baseline for p in self.prompts])

    @property
    def hf_generate_tokens_per_s(self) -> float | None:
        """HF ``generate``'s rate (the lossless reference; not a serving speed: Python's time per layer)."""
        return _rate([p.greedy for p in self.prompts])

    @property
    def mismatches(self) -> int:
        return sum(p.lossless is False for p in self.prompts)

    def check_lossless(self) -> None:
        """Raises `LosslessError` naming every prompt whose output differs from greedy decoding, and where."""
        problems = []
        for i, p in enumerate(self.prompts):
            if p.lossless is False:
                try:
                    check_lossless(
                        p.spec.tokens, p.greedy.tokens, where=f"prompt {i} ({p.prompt_tokens} tokens)"
                    )
                except LosslessError as exc:
                    problems.append(str(exc))
        if problems:
            raise LosslessError(f"{len(problems)} of {len(self.prompts)} prompts: " + "\n".join(problems))

    def metrics(self) -> dict[str, Any]:
        """The ``real/...`` keys of metrics.jsonl."""
        c = self.counts
        out: dict[str, Any] = {
            "tau": self.tau,
            "tau_pooled": c.tau,
            "acceptance_per_position": [float(x) for x in c.per_slot_rate[1:]],
            "steps": c.anchors,
            "prompts": len(self.prompts),
            "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s,
            "seconds": self.seconds,
            # where a step's time goes: the drafter's proposal and the target's verify forward
            "draft_ms_per_step": 1e3 * sum(p.spec.propose_seconds for p in self.prompts) / max(c.anchors, 1),
            "verify_ms_per_step": 1e3 * sum(p.spec.verify_seconds for p in self.prompts) / max(c.anchors, 1),
        }
        if (greedy := self.greedy_tokens_per_s) is not None:
            out["greedy_tokens_per_s"] = greedy
            out["speedup"] = self.tokens_per_s / greedy if greedy > 0 else 0.0
            out["hf_generate_tokens_per_s"] = self.hf_generate_tokens_per_s
            out["lossless_mismatches"] = self.mismatches
        return {METRIC_PREFIX + k: v for k, v in out.items()}


def _rate(outputs: Sequence[GreedyOutput | None]) -> float | None:
    """Tokens per second over every prompt's output; None unless each prompt has one."""
    if not outputs or any(o is None for o in outputs):
        return None
    seconds = sum(o.seconds for o in outputs)  # type: ignore[union-attr]
    return sum(len(o.tokens) for o in outputs) / seconds if seconds > 0 else None  # type: ignore[union-attr]


def reference_for(
    target: nn.Module,
    prompt: Tensor,
    *,
    layer_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    warm: bool = False,
) -> Reference:
    """``prompt``'s greedy decoding by HF ``generate`` and on the verify stack. ``warm``: the stack's runs
    once untimed first, so the speedup's baseline is not timed cold (kernels' first launches, CUDA graph
    captures); HF ``generate`` is the check, not the baseline, and runs once."""

    def baseline() -> GreedyOutput:
        return stack_greedy_generate(
            target, prompt, layer_ids=layer_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids
        )

    if warm:
        baseline()
    return Reference(
        greedy=greedy_generate(target, prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids),
        baseline=baseline(),
    )


def prompts_from_samples(samples: Sequence[Any], max_prompts: int) -> list[Tensor]:
    """Up to ``max_prompts`` prompts: each sample's tokens before its first trained (assistant) token.

    ``samples``: objects with ``input_ids`` [S] and ``loss_mask`` [S] (a sample with no assistant token, or
    one that starts with it, has no prompt and is skipped)."""
    out = []
    for s in samples:
        if len(out) >= max_prompts:
            break
        trained = torch.nonzero(torch.as_tensor(s.loss_mask).bool().flatten())
        if trained.numel() and int(trained[0]) > 0:
            out.append(torch.as_tensor(s.input_ids).flatten()[: int(trained[0])].cpu().long())
    return out


def end_of_turn_ids(tokenizer: Any, model_dir: str | Path | None = None) -> list[int]:
    """The tokens that end an assistant turn, by the same rule regeneration stops at
    (``dflash_pipe.target.generate.end_of_turn_ids``: the chat template's terminator, the model's
    ``generation_config.json`` eos ids, the tokenizer's eos), read from the target's directory."""
    from dflash_pipe.target.generate import end_of_turn_ids as target_end_of_turn_ids

    generation_config = None
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(str(model_dir))
    return target_end_of_turn_ids(tokenizer, generation_config)


def load_eval_target(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The target as a plain HF causal LM with SDPA attention and a KV cache: how it is served."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False).to(device)


@torch.inference_mode()
def evaluate_generate(
    target: nn.Module,
    drafter: DFlashDrafter,
    prompts: Sequence[Tensor],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    check: bool = True,
    strict: bool = True,
    references: dict[int, Reference] | None = None,
    progress: bool = False,
    graphs: bool | GraphedProposer = False,
) -> GenerateResult:
    """Speculative decoding of every prompt; with ``check``, the target's greedy decoding of each too
    (from ``references`` when it holds the prompt's index, stored there otherwise). ``strict``: raise
    `LosslessError` on the first prompt whose output differs (else count it in ``lossless_mismatches``).
    ``graphs``: True drafts through captured CUDA graphs (a CUDA drafter with eager layers), a
    ``GraphedProposer`` through that one (e.g. one that checks its drafts); False: the drafter's forward
    launched step by step. Off by default: on a GPU the graphs drafted other tokens (docs/performance.md)."""
    if not prompts:
        raise ValueError("no prompts to evaluate: the held-out samples have no turn before an assistant turn")
    if graphs is True and not graphs_apply(drafter):
        raise ValueError(
            "graphs=True: the draft step is captured only for a drafter on CUDA with eager layers; "
            f"this one is on {drafter.fc.weight.device} with {drafter.kernels}"
        )
    was_training = drafter.training
    drafter.eval()
    if isinstance(graphs, GraphedProposer):
        propose = graphs
    else:
        propose = GraphedProposer(drafter) if graphs else drafter_proposer(drafter)
    results = []
    warmed = False  # the first reference computed in this call is timed warm
    try:
        with Progress(
            TextColumn("speculative decoding"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not progress,
        ) as bar:
            task = bar.add_task("generate", total=len(prompts))
            for i, prompt in enumerate(prompts):
                spec = speculative_generate(
                    target,
                    propose,
                    prompt,
                    layer_ids=drafter.cfg.target_layer_ids,
                    block_size=drafter.cfg.block_size,
                    max_new_tokens=max_new_tokens,
                    stop_ids=stop_ids,
                )
                if isinstance(propose, GraphedProposer):
                    propose.settle()  # its check (if on) compares this prompt's drafts now
                ref = None
                if check:
                    ref = references.get(i) if references is not None else None
                    if ref is None:
                        ref = reference_for(
                            target,
                            prompt,
                            layer_ids=drafter.cfg.target_layer_ids,
                            max_new_tokens=max_new_tokens,
                            stop_ids=stop_ids,
                            warm=not warmed,
                        )
                        warmed = True
                        if references is not None:
                            references[i] = ref
                    if strict:
                        check_lossless(
                            spec.tokens, ref.greedy.tokens, where=f"prompt {i} ({prompt.numel()} tokens)"
                        )
                results.append(
                    PromptResult(
                        prompt_tokens=int(prompt.numel()),
                        spec=spec,
                        greedy=ref and ref.greedy,
                        baseline=ref and ref.baseline,
                    )
                )
                bar.advance(task)
    finally:
        drafter.train(was_training)
    return GenerateResult(prompts=results, block_size=drafter.cfg.block_size)


def load_eval_drafter(drafter_dir: str | Path, target: nn.Module, device: torch.device, dtype: torch.dtype):
    """An exported drafter (already verified) drafting with ``target``'s own embedding and LM head: fp32
    weights under the training step's autocast when ``dtype`` is the compute dtype, else wholly in ``dtype``."""
    from .export import load_exported

    drafter = load_exported(
        drafter_dir,
        embed_tokens=target.get_input_embeddings(),
        lm_head=target.get_output_embeddings(),
        verify=False,
    ).to(device)
    return drafter if dtype == compute_dtype(device) else drafter.to(dtype)


def eval_precision(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The autocast of the training step when evaluating in the compute dtype; nothing in any other."""
    return autocast(device) if dtype == compute_dtype(device) else contextlib.nullcontext()


def evaluate_export(
    target_model: str | Path,
    drafter_dir: str | Path,
    samples: Sequence[Any],
    *,
    tokenizer: Any,
    device: torch.device,
    max_prompts: int,
    max_new_tokens: int,
    check: bool = True,
    progress: bool = False,
    warn: Callable[[str], None] | None = None,
    dtype: torch.dtype | None = None,
) -> GenerateResult:
    """`dflash-pipe eval --mode generate`: the target (bf16 on CUDA) and an exported drafter drafting with the
    target's own embedding and LM head, over the prompts of ``samples``. Every prompt runs; the caller checks
    ``result.check_lossless()``. The export is checked against its manifest before the target loads (``warn``
    hears that one without a manifest is unverified). ``dtype``: the target's and drafter's (default the
    compute dtype, bf16 on CUDA). In bf16 the target's verify forward over a block and its one-token decode
    round differently, so near-ties can flip the greedy token and a correct drafter fails the lossless check
    (seen on an H100 with SmolLM2-135M even for a drafter that had nothing accepted); float32 makes the
    check exact."""
    from .export import verify_export

    verify_export(drafter_dir, warn=warn)
    dtype = dtype or compute_dtype(device)
    target = load_eval_target(target_model, device, dtype)
    drafter = load_eval_drafter(drafter_dir, target, device, dtype)
    with eval_precision(device, dtype):
        return evaluate_generate(
            target,
            drafter,
            prompts_from_samples(samples, max_prompts),
            max_new_tokens=max_new_tokens,
            stop_ids=end_of_turn_ids(tokenizer, target_model),
            check=check,
            strict=False,
            progress=progress,
        )


def render_generate_table(result: GenerateResult) -> Table:
    """tau, speed and per-position acceptance of real speculative decoding, for the terminal."""
    c = result.counts
    greedy = result.greedy_tokens_per_s
    title = (
        f"real acceptance (speculative decoding, greedy): tau = {result.tau:.3f} (mean of the prompts; "
        f"{c.tau:.3f} over all {c.anchors} steps), "
        f"{len(result.prompts)} prompts, {result.new_tokens} tokens, {result.tokens_per_s:,.1f} tokens/s"
    )
    if greedy is not None:
        speedup = result.tokens_per_s / greedy
        title += f" (greedy decoding on the same stack {greedy:,.1f} tokens/s, x{speedup:.2f}); "
        title += "lossless" if result.mismatches == 0 else f"{result.mismatches} prompt(s) NOT lossless"
    return per_slot_table(c, title, columns=("draft position k", "steps that kept it", "rate"))


__all__ = [
    "GenerateResult",
    "LosslessError",
    "PromptResult",
    "Reference",
    "end_of_turn_ids",
    "evaluate_export",
    "eval_precision",
    "evaluate_generate",
    "load_eval_drafter",
    "load_eval_target",
    "prompts_from_samples",
    "reference_for",
    "render_generate_table",
]
