"""Online regeneration in the producer: what the target replicas generate next, what their replies become,
and epoch 0's batches planned as the replies arrive.

The target threads take ``GenerateJob``s from the same queue as feature batches (one job per idle replica
at most, so features for the workers are never queued behind more than one job per replica) and hand back
``GenerateDone``. The main thread (``Regeneration.accept``) appends the replies to the run's regenerated
file, turns them into training samples (``data.regen_samples``) and makes them plannable; epoch 0
(``epoch0``) yields batches of what has arrived, and ``None`` while the rest is still being generated.
Later epochs plan every sample, as a run on dataset responses does. Sample ids are conversation indexes: a
conversation left with nothing to train (every turn failed, or too short) is a *void* id that no epoch
plans.

The held-out conversations (the file's tail) are generation jobs too, handed out right after the first
training job: serving and training start at once, and the eval set exists a job or two later
(``eval_ready``), instead of every worker waiting for it before its WELCOME.
"""

from __future__ import annotations

import copy
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipe.data import DataConfig, Sample, plan_batches
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.conversations import SourceConversations
from dflash_pipe.data.regen_samples import sample_or_reason, to_sample
from dflash_pipe.data.regenerated import Regenerated, RegenStore, RegenTally
from dflash_pipe.data.spill import SpilledSamples
from dflash_pipe.producer.failed_notes import FailedTurnNotes
from dflash_pipe.target.decode.sizing import FALLBACK_SLOTS, FREE_SHARE, SHARED_FREE_SHARE
from dflash_pipe.telemetry import RateMeter

SORT_WINDOW_JOBS = 8
"""Conversations are sorted by length within windows of this many jobs (see ``Regeneration.next_job``)."""


def _chars(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)


@dataclass(slots=True)
class GenerateJob:
    """Conversations a target replica regenerates in one batched call."""

    job_id: int
    items: list[tuple[int, list[dict[str, str]]]]


@dataclass(slots=True)
class GenerateDone:
    """Conversations of a job, regenerated, sent back through the ready queue as they finish (the first
    step needs a batch's worth of replies, not a whole job's)."""

    job: GenerateJob
    results: list[Regenerated]
    seconds: float
    """The job's target-thread seconds (on its ``last`` answer; 0 before)."""
    replica: str
    last: bool = True
    """The job's last conversations: the job is answered (its replica may take another)."""


class Regeneration:
    """The regeneration of a run: conversations to generate, samples made of the replies, epoch 0's plans.

    Lives in the producer's main thread (only ``make_generator`` runs in the target threads).
    """

    def __init__(
        self,
        source: SourceConversations,
        num_train: int,
        store: RegenStore,
        settings: RegenConfig,
        data: DataConfig,
        tokenizer: Any,
        *,
        seed: int,
        spill_dir: Path | None = None,
    ) -> None:
        """``spill_dir``: where the samples made of the replies are kept (``data.spill``: an anonymous file,
        a few bytes of memory a sample), the run dir in a run; None: in memory (tests, small data)."""
        self.source = source
        self.num_train = num_train
        self.store = store
        self.settings = settings
        self.data = data
        self.tokenizer = tokenizer
        self.seed = seed
        self.tally = RegenTally()
        """What this process generated (the file's earlier lines are counted in ``reused``)."""
        self.reused = len(store.done)
        self.rate = RateMeter()
        """Generated tokens per second."""
        self._generators: dict[int, Any] = {}
        self.job_size = settings.batch_size or FALLBACK_SLOTS
        """Conversations per ``GenerateJob``: the replicas' slots (``size_jobs`` when auto)."""
        self.memory_share = FREE_SHARE
        self.generate_s = 0.0
        """Target-thread seconds spent generating (the jobs' own times, summed over replicas)."""
        self.train_samples: SpilledSamples | list[Sample | None] = (
            [None] * num_train if spill_dir is None else SpilledSamples(spill_dir, num_train)
        )
        self._lengths = np.zeros(num_train, dtype=np.int64)
        """Tokens of each training sample (0: none yet, or a void): plans read these, not the samples."""
        self.voids: set[int] = set()
        self.void_reasons: Counter[str] = Counter()
        """Why each void has nothing to train (its first turn's failure, or the loader's drop reason)."""
        self._done = 0
        for index, record in store.done.items():
            if index < num_train:
                self._place(record)
        self._todo = deque(i for i in range(num_train) if i not in store.done)
        self.eval_indexes = range(num_train, len(source.conversations))
        """The held-out conversations (the file's tail): the eval set, never trained."""
        self._eval_todo = deque(i for i in self.eval_indexes if i not in store.done)
        self._eval_left = len(self._eval_todo)
        """Held-out conversations not back yet (handed out or not)."""
        self._window: deque[int] = deque()
        self._jobs = 0
        self._arrived: list[int] = []
        self.failed_notes = FailedTurnNotes()
        self.started: float | None = None
        """When the first generation was handed out (None: nothing to generate in this process)."""
        self.finished: float | None = None
        """When the last reply (training or held-out) arrived."""

    # --- what the target threads generate --------------------------------------------------------------

    def make_generator(self, core: Any) -> Any:
        """The ``TurnGenerator`` of one replica (its own tokenizer copy: the main thread renders meanwhile),
        made once, so its slot cache is allocated and its decode step compiled once."""
        from dflash_pipe.target.generate import TurnGenerator

        key = id(core)
        if key not in self._generators:
            self._generators[key] = TurnGenerator(
                core.model,
                copy.deepcopy(self.tokenizer),
                self.settings,
                device=core.device,
                max_length=self.data.max_length,
                template_kwargs=self.data.chat_template_kwargs,
                memory_share=self.memory_share,
            )
        return self._generators[key]

    def size_jobs(self, cores: list[Any], *, drafters_share_gpus: bool) -> str | None:
        """With an auto ``batch_size`` (0): builds each replica's generator now (its engine sized from the
        memory free on its GPUs, less when drafters share them) and makes a job as many conversations as
        the smallest one's slots. Call before the target threads start. Returns the line to log."""
        if self.settings.batch_size:
            return None
        self.memory_share = SHARED_FREE_SHARE if drafters_share_gpus else FREE_SHARE
        self.job_size = min(self.make_generator(core).batch_size for core in cores)
        return f"regeneration: {self.job_size} conversations a job per replica (--regen-batch auto)"

    def next_job(self) -> GenerateJob | None:
        """The next conversations to regenerate, None when every one is done or handed out.

        The first job is training conversations (the first step waits for nothing else), the held-out
        ones come next, in jobs of their own, then the rest of the training set. Training jobs are cut from
        windows of ``SORT_WINDOW_JOBS`` jobs' worth of conversations (in file order), sorted by length within
        the window: a job's prompts are left-padded to its longest, so similar lengths waste less, while
        epoch 0 still moves through the file in order."""
        if self._eval_todo and (self._jobs > 0 or not (self._todo or self._window)):
            self.started = self.started or time.monotonic()
            take = min(len(self._eval_todo), self.job_size)
            items = [
                (i, self.source.conversations[i]) for i in (self._eval_todo.popleft() for _ in range(take))
            ]
            self._jobs += 1
            return GenerateJob(job_id=self._jobs, items=items)
        if not self._window:
            take = min(len(self._todo), SORT_WINDOW_JOBS * self.job_size)
            window = [self._todo.popleft() for _ in range(take)]
            self._window.extend(sorted(window, key=lambda i: _chars(self.source.conversations[i])))
        if not self._window:
            return None
        self.started = self.started or time.monotonic()
        items = []
        while self._window and len(items) < self.job_size:
            index = self._window.popleft()
            items.append((index, self.source.conversations[index]))
        self._jobs += 1
        return GenerateJob(job_id=self._jobs, items=items)

    def accept(self, *dones: GenerateDone) -> str | None:
        """Writes the conversations of ``dones`` (what the target threads finished since the last call) to the
        regenerated file, in one flush, and makes their samples plannable; returns the line the dashboard
        shows when some turn could not be generated (at most one per ``failed_notes.EVERY_S``)."""
        records = [record for done in dones for record in done.results]
        self.store.append(records)
        self.generate_s += sum(done.seconds for done in dones)
        for record in records:
            self.tally.add(record)
            self.rate.add(record.new_tokens)
            if record.index >= self.num_train:
                self._eval_left -= 1
            elif self._place(record) is not None:
                self._arrived.append(record.index)
        if self.complete and self.eval_ready and self.finished is None:
            self.finished = time.monotonic()
        self.failed_notes.add(
            (done.job.job_id, rec) for done in dones for rec in done.results if rec.failed is not None
        )
        return self.failed_notes.line(self.tally.failed_text())

    def _place(self, record: Regenerated) -> Sample | None:
        made = sample_or_reason(record, record.index, self.tokenizer, self.data)
        self._done += 1
        if isinstance(made, str):
            self.voids.add(record.index)
            self.void_reasons[made] += 1
            return None
        self.train_samples[record.index] = made
        self._lengths[record.index] = made.input_ids.numel()
        return made

    @property
    def samples_ready(self) -> int:
        """Training samples made so far (now or from the file)."""
        return int(np.count_nonzero(self._lengths))

    def nothing_to_train(self) -> str | None:
        """Once every training conversation is regenerated (now or in the file): why no sample came out of
        them, else None."""
        if not self.complete or len(self.voids) < self.num_train:
            return None
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.void_reasons.items()))
        return (
            f"regeneration left no sample to train: all {self.num_train} training conversations came out with "
            f"nothing to train ({why}). Check data.max_length (prompts must fit under it) and that the target "
            "writes replies (its chat template and end-of-turn token)"
        )

    @property
    def complete(self) -> bool:
        """Every training conversation regenerated (and written)."""
        return self._done >= self.num_train

    @property
    def done(self) -> int:
        return self._done

    @property
    def eval_ready(self) -> bool:
        """Every held-out conversation regenerated (and written), or reused from the file."""
        return self._eval_left == 0

    def eval_samples(self) -> list[Sample]:
        """The eval set: the held-out conversations as samples (those with something to evaluate), once
        ``eval_ready``."""
        if not self.eval_ready:
            raise RuntimeError(
                f"the eval set is not regenerated yet ({self._eval_left} conversation(s) left)"
            )
        samples = (to_sample(self.store.done[i], i, self.tokenizer, self.data) for i in self.eval_indexes)
        return [s for s in samples if s is not None]

    # --- planning --------------------------------------------------------------------------------------

    def epoch0(self, exclude: set[int]) -> Iterator[list[int] | None]:
        """Epoch 0's batches: first the samples that exist (minus ``exclude``), then batches of the replies
        as they arrive (a batch once ``token_budget`` tokens have come, the rest at the end); ``None`` while
        nothing can be planned yet but conversations are still being generated."""
        ready = [int(i) for i in np.flatnonzero(self._lengths) if int(i) not in exclude]
        self._arrived.clear()  # what arrived before now is in `ready`
        yield from self._plan(ready, hold_back=False)
        while True:
            if self._arrived and (self.complete or self._arrived_tokens() >= self.data.token_budget):
                batch, self._arrived = self._arrived, []
                yield from self._plan(batch, hold_back=not self.complete)
            elif self.complete:
                return
            else:
                yield None

    def later_epoch(self, epoch: int, exclude: set[int]) -> list[list[int]]:
        """Any epoch after the first: every sample, planned as dataset responses are (voids left out)."""
        lengths = self._lengths.tolist()
        return plan_batches(
            lengths, self.data.token_budget, seed=self.seed, epoch=epoch, exclude=set(exclude) | self.voids
        )

    def _arrived_tokens(self) -> int:
        return int(self._lengths[self._arrived].sum())

    def _plan(self, ids: list[int], *, hold_back: bool) -> Iterator[list[int]]:
        """``ids`` packed by the token budget; with ``hold_back`` the least-filled batch waits for the next
        arrivals instead of going out short."""
        if not ids:
            return
        lengths = self._lengths[ids].tolist()
        planned = plan_batches(lengths, self.data.token_budget, seed=self.seed, epoch=0)
        if hold_back and len(planned) > 1:
            short = min(range(len(planned)), key=lambda b: sum(lengths[j] for j in planned[b]))
            self._arrived.extend(ids[j] for j in planned.pop(short))
        for b in planned:
            yield [ids[j] for j in b]

    # --- reporting -------------------------------------------------------------------------------------

    def kept_text(self) -> str:
        """What a stopped regeneration leaves: the conversations in the file (a launch with ``--resume``
        on the run dir reuses them and generates only the rest)."""
        total = self.num_train + len(self.eval_indexes)
        return (
            f"regeneration stopped with {len(self.store.done)}/{total} conversations in {self.store.path} "
            f"({self.tally.conversations} written by this launch); --resume keeps them and generates the rest"
        )

    def status(self, replicas: int = 1, generate_s: float | None = None) -> dict[str, float]:
        """For the dashboard and the metrics: conversations done of all, tokens/s, failed turns, replies
        that ran to the cap or ended in a loop (of this process's), and the
        share of the ``replicas``' time since the first job spent generating: ``generate_s`` seconds (the
        target threads' own count), else the finished jobs' seconds."""
        elapsed = 0.0 if self.started is None else (self.finished or time.monotonic()) - self.started
        spent = self.generate_s if generate_s is None else generate_s
        share = min(1.0, spent / (elapsed * max(1, replicas))) if elapsed > 0 else 0.0
        return {
            "done": float(self._done),
            "total": float(self.num_train),
            "eval_done": float(len(self.eval_indexes) - self._eval_left),
            "eval_total": float(len(self.eval_indexes)),
            "tokens_per_s": self.rate.rate() if self.rate.span() >= 1.0 else 0.0,
            "failed_turns": float(sum(self.tally.failed.values())),
            "capped_turns": float(self.tally.capped_turns),
            "looped_turns": float(self.tally.looped_turns),
            "dropped": float(len(self.voids)),
            "target_share": share,
        }

    def summary(self) -> dict[str, Any]:
        """The run summary's regeneration line."""
        elapsed = 0.0 if self.started is None else (self.finished or time.monotonic()) - self.started
        return {
            "file": str(self.store.path),
            "conversations_generated": self.tally.conversations,
            "conversations_reused": self.reused,
            "turns": self.tally.turns,
            "truncated_turns": self.tally.truncated_turns,
            "capped_turns": self.tally.capped_turns,
            "looped_turns": self.tally.looped_turns,
            "max_new_tokens": self.settings.max_new_tokens,
            "failed_turns": dict(self.tally.failed),
            "skipped_turns": self.tally.skipped_turns,
            "dropped_conversations": len(self.voids),
            "rendered_conversations": self.tally.rendered,
            "new_tokens": self.tally.new_tokens,
            "seconds": elapsed,
        }


def first_open_epoch(ledger: Any, voids: set[int]) -> int:
    """The first epoch with a sample left to train: ``Ledger.current_epoch`` where the void ids (regenerated
    conversations with nothing to train) count as trained, since no epoch plans them."""
    for epoch in range(ledger.epochs):
        if ledger.count(epoch) + len(voids - ledger.trained(epoch)) < ledger.num_samples:
            return epoch
    return ledger.epochs
