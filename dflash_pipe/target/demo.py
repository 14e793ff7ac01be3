"""The embedded default target: a tiny Qwen3 trained briefly on the bundled sample conversations.

A random target would make drafter acceptance meaningless (its greedy predictions are noise), so the demo
target is trained on CPU for a few hundred steps until its greedy predictions follow the data. The build is
cached: a small fingerprint json (model config + data hash + tokenizer hash + recipe) marks a complete
build, and the build is written to a temp dir and renamed so a crash never leaves half a target behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from filelock import FileLock
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from dflash_pipe.run.manifest import chmod_from_umask

# Bump when the build changes in a way the fingerprint's other fields do not capture.
RECIPE_VERSION = 1
FINGERPRINT_FILE = "dflash_demo_target.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", FINGERPRINT_FILE)


@dataclass(kw_only=True, slots=True)
class DemoRecipe:
    """How the demo target is trained (all of it enters the fingerprint)."""

    steps: int = 120
    """Optimizer steps; 0 saves the seeded random init (useful as a baseline and in tests)."""
    batch_size: int = 16
    """Samples per step (right-padded)."""
    seq_len: int = 256
    """Samples are truncated to this many tokens."""
    lr: float = 5e-3
    """Peak AdamW learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = 20
    """Linear warmup length in steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    seed: int = 0
    """Seeds the init and the batch sampling."""

    def __post_init__(self) -> None:
        for name in ("steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"DemoRecipe.{name}={getattr(self, name)} must be >= 0")
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) < 2:
                raise ValueError(f"DemoRecipe.{name}={getattr(self, name)} must be >= 2")
        if not self.lr > 0:
            raise ValueError(f"DemoRecipe.lr={self.lr} must be > 0, e.g. 5e-3")
        if self.weight_decay < 0:
            raise ValueError(f"DemoRecipe.weight_decay={self.weight_decay} must be >= 0")


def default_cache_dir() -> Path:
    """Where the demo target is cached: ``$DFLASH_PIPE_CACHE/demo-target`` or ``~/.cache/dflash-pipe/...``."""
    root = os.environ.get("DFLASH_PIPE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "dflash-pipe"
    return base / "demo-target"


def demo_model_config(tokenizer) -> Qwen3Config:
    """The demo target's architecture: a 6-layer, 128-wide Qwen3 over the demo tokenizer's vocabulary."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_demo_target(
    out_dir: Path | str | None = None,
    *,
    recipe: DemoRecipe | None = None,
    tokenizer=None,
    data_path: Path | None = None,
    progress: bool | None = None,
) -> Path:
    """Materialise the demo target (config, safetensors, tokenizer) in ``out_dir`` and return it.

    Returns at once when ``out_dir`` already holds a complete build with the same fingerprint. Defaults:
    ``out_dir`` = ``default_cache_dir()``, the bundled demo tokenizer and data, ``DemoRecipe()``;
    ``progress`` = a rich progress bar when stderr is a terminal.
    """
    from dflash_pipe.data import demo_data_path, demo_tokenizer

    out = Path(out_dir) if out_dir is not None else default_cache_dir()
    recipe = recipe or DemoRecipe()
    tokenizer = tokenizer if tokenizer is not None else demo_tokenizer()
    data_path = Path(data_path) if data_path is not None else demo_data_path()
    config = demo_model_config(tokenizer)
    fingerprint = _fingerprint(config, tokenizer, data_path, recipe)
    if _is_complete(out, fingerprint):
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if _is_complete(out, fingerprint):  # another process built it while we waited
            return out
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            stats = _train_and_save(tmp, config, tokenizer, data_path, recipe, progress)
            (tmp / FINGERPRINT_FILE).write_text(
                json.dumps({"fingerprint": fingerprint, "train": stats}, indent=2, sort_keys=True)
            )
            for f in tmp.iterdir():  # save_pretrained's safetensors are 0600: the umask's mode instead
                if f.is_file():
                    chmod_from_umask(f)
            if out.exists():  # stale or foreign build: move it aside first, rename is then atomic
                old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
                out.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_build_info(out_dir: Path | str) -> dict:
    """The fingerprint json of a build (``fingerprint`` and ``train`` stats: losses, seconds)."""
    return json.loads((Path(out_dir) / FINGERPRINT_FILE).read_text())


def _fingerprint(config: Qwen3Config, tokenizer, data_path: Path, recipe: DemoRecipe) -> dict:
    cfg = config.to_dict()
    cfg.pop("transformers_version", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tok_text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    tok_text += str(getattr(tokenizer, "chat_template", None))
    return {
        "recipe_version": RECIPE_VERSION,
        "recipe": asdict(recipe),
        "config": json.loads(json.dumps(cfg, sort_keys=True, default=str)),
        "data_sha256": hashlib.sha256(data_path.read_bytes()).hexdigest(),
        "tokenizer_sha256": hashlib.sha256(tok_text.encode()).hexdigest(),
    }


def _is_complete(out: Path, fingerprint: dict) -> bool:
    if not all((out / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        return read_build_info(out).get("fingerprint") == fingerprint
    except (OSError, ValueError):
        return False


def _train_and_save(
    tmp: Path, config: Qwen3Config, tokenizer, data_path: Path, recipe: DemoRecipe, progress: bool | None
) -> dict:
    """Seeded init, a short next-token-CE run on the demo data, then save model + tokenizer to ``tmp``."""
    from dflash_pipe.data import DataConfig, load_samples

    data = load_samples(DataConfig(path=data_path, max_length=recipe.seq_len), tokenizer)
    # Sorted by length: a batch is a random window of neighbours, so right padding wastes little compute.
    rows = sorted((s.input_ids for s in data.samples if s.input_ids.numel() >= 2), key=len)
    if len(rows) < recipe.batch_size:
        raise ValueError(
            f"demo data {data_path} has {len(rows)} usable samples, fewer than DemoRecipe.batch_size="
            f"{recipe.batch_size}; lower batch_size or add data"
        )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = Qwen3ForCausalLM(config)
    model.train()
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay, foreach=True
    )

    losses: list[float] = []
    start = time.perf_counter()
    show = sys.stderr.isatty() if progress is None else progress
    threads, build_threads = torch.get_num_threads(), _free_threads(torch.get_num_threads())
    torch.set_num_threads(build_threads)
    try:
        with _progress_bar(show, recipe.steps) as advance:
            _train_loop(model, opt, rows, recipe, gen, losses, advance)
    finally:
        torch.set_num_threads(threads)

    model.eval()
    with _quiet_hf_progress():  # our own bar already said what happens; no "Writing model shards" noise
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    tail = losses[-10:]
    return {
        "steps": recipe.steps,
        "train_seconds": round(time.perf_counter() - start, 2),
        "loss_first": losses[0] if losses else None,
        "loss_last10": sum(tail) / len(tail) if tail else None,
        "num_samples": len(rows),
        "threads": build_threads,
    }


def _lr_at(recipe: DemoRecipe, step: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    t = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _train_loop(
    model: Qwen3ForCausalLM,
    opt: torch.optim.Optimizer,
    rows: list[torch.Tensor],
    recipe: DemoRecipe,
    gen: torch.Generator,
    losses: list[float],
    advance,
) -> None:
    for step in range(recipe.steps):
        first = int(torch.randint(len(rows) - recipe.batch_size + 1, (1,), generator=gen))
        input_ids, labels, attention_mask = _pad_batch(rows[first : first + recipe.batch_size])
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, S, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        for group in opt.param_groups:
            group["lr"] = _lr_at(recipe, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        advance(losses[-1])


def _free_threads(current: int) -> int:
    """Intra-op threads for the build: no more than the idle cores.

    The demo model's ops are tiny, and oversubscribed OpenMP threads spin: on a 2-core machine with two
    other busy processes, 2 threads ran a step 4-7x slower than 1 thread.
    """
    try:
        idle = (os.cpu_count() or 1) - os.getloadavg()[0]
    except OSError:  # getloadavg is unavailable on some platforms
        return current
    return max(1, min(current, 4, math.floor(idle + 0.5)))


def _pad_batch(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad samples: ``input_ids [B, S]``, ``labels [B, S]`` (-100 on padding), ``attention_mask``."""
    width = max(r.numel() for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, S]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, S]
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # [B, S]
    for b, r in enumerate(rows):
        input_ids[b, : r.numel()] = r
        labels[b, : r.numel()] = r
        mask[b, : r.numel()] = 1
    return input_ids, labels, mask


@contextlib.contextmanager
def _quiet_hf_progress() -> Iterator[None]:
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


class _progress_bar:
    """A rich progress bar on stderr (or nothing); ``advance(loss)`` per step."""

    def __init__(self, show: bool, total: int) -> None:
        self._progress = None
        if show and total > 0:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("building demo target"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._progress.add_task("train", total=total, loss="-")

    def __enter__(self):
        if self._progress is None:
            return lambda loss: None
        self._progress.__enter__()
        return lambda loss: self._progress.update(self._task, advance=1, loss=f"{loss:.3f}")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
