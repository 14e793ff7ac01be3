"""The one run configuration: every part's config composed, validated at the edge, saved in the run dir."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash_pipe.config.presets import PRESETS, presets_help
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.data import DataConfig
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.fields import build, check_choice, flag
from dflash_pipe.run.files import COMPILE_CACHE_DIR
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.wire.addresses import DEFAULT_ADDRESS, require_keys_for


@dataclass(kw_only=True, slots=True)
class DrafterOptions:
    """What the user chooses about the drafter; the rest is derived from the target's config."""

    preset: str | None = field(
        default=None,
        metadata=flag(
            "--drafter-preset",
            "A served drafter's shape (widths follow the target; the flags below override its fields): "
            + presets_help()
            + ".",
            choices=tuple(PRESETS),
        ),
    )
    """A published drafter's shape (docs/drafter.md): sets num_layers, block_size, layer_types and
    sliding_window, each still overridable; widths always follow the target."""
    num_layers: int = field(default=5, metadata=flag("--draft-layers", "Drafter depth (default 5)."))
    block_size: int = field(default=16, metadata=flag("--block-size", "Draft block size (default 16)."))
    layer_types: tuple[str, ...] | None = field(
        default=None,
        metadata=flag(
            "--layer-types",
            "Attention of each draft layer, comma-separated: full_attention or sliding_attention "
            "(full/sliding for short), e.g. sliding,sliding,sliding,sliding,full (default: all full).",
        ),
    )
    """One per draft layer: full_attention or sliding_attention (comma-separated on the command line;
    full/sliding for short). None: all full_attention."""
    sliding_window: int | None = field(
        default=None,
        metadata=flag(
            "--sliding-window",
            "Keys a sliding_attention layer sees, the query included (e.g. 2048); needs sliding layers.",
        ),
    )
    """Keys a sliding_attention layer sees, the query included (e.g. 2048); only with sliding layers."""
    mask_token_id: int | None = field(
        default=None,
        metadata=flag("--mask-token-id", "Mask token (default: a reserved token of the tokenizer)."),
    )
    """None: a reserved token of the tokenizer (e.g. <|mask|>), or an error saying to set it."""
    target_layer_ids: tuple[int, ...] | None = field(
        default=None,
        metadata=flag(
            "--target-layer-ids", "Comma-separated target layers to read (default: the even-spread rule)."
        ),
    )
    """None: the even-spread rule of the DFlash reference."""
    attention_backend: Literal["auto", "flex", "sdpa"] = field(
        default="auto",
        metadata=flag(
            "--attention",
            "Drafter attention backend (auto: flex on CUDA, SDPA on CPU).",
            param="attention_backend",
        ),
    )
    max_anchors: int = field(
        default=512, metadata=flag("--max-anchors", "Sampled blocks per sequence (recipe: 512; demo: 32).")
    )

    def __post_init__(self) -> None:
        if self.target_layer_ids is not None:
            self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}.")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {self.block_size}.")
        check_choice(self, "attention_backend", "drafter.attention_backend")
        if self.max_anchors < 1:
            raise ValueError(f"drafter.max_anchors must be >= 1, got {self.max_anchors}.")
        from dflash_pipe.config.drafter import check_layer_types

        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"drafter.preset {self.preset!r} (--drafter-preset): unknown; choose one of {', '.join(PRESETS)}."
            )
        names = ("drafter.layer_types (--layer-types)", "drafter.sliding_window (--sliding-window)")
        if self.layer_types is not None:
            self.layer_types = check_layer_types(
                self.layer_types, self.num_layers, self.sliding_window, names=names
            )
        else:
            check_layer_types(None, self.num_layers, self.sliding_window, names=names)


@dataclass(kw_only=True, slots=True)
class WireConfig:
    bind: str = field(
        default=DEFAULT_ADDRESS,
        metadata=flag("--bind", "Producer address (default tcp://127.0.0.1:0, a free loopback port)."),
    )
    """Producer address; port 0 picks a free one. Anything but loopback or ipc:// needs `keys`."""
    keys: Path | None = field(
        default=None,
        metadata=flag(
            "--keys",
            "CURVE key directory (`dflash-pipe keys generate DIR`); needed when --bind is not loopback.",
            resume=True,
        ),
    )
    """CURVE key directory (`dflash-pipe keys generate DIR`): workers must hold its client key to connect."""
    ready_batches: int = 4
    """Batches of features the producer keeps computed ahead of demand (host memory bound)."""
    worker_credits: int = 2
    """Batches each worker may hold at once (one training, the rest in flight)."""
    heartbeat_s: float = 2.0
    peer_timeout_s: float = field(
        default=120.0,
        metadata=flag(
            "--peer-timeout",
            "Seconds of silence after which a worker or the producer is declared dead (default 120).",
            resume=True,
        ),
    )
    """A peer silent this long is declared dead (covers a cold torch.compile)."""
    join_timeout_s: float = 600.0
    """How long the producer waits for all launched workers to say HELLO."""
    reconnect_timeout_s: float = field(
        default=300.0,
        metadata=flag(
            "--reconnect-timeout",
            "Seconds the launched workers keep retrying a lost producer, waiting for --resume (default 300).",
            resume=True,
        ),
    )
    """How long a launched worker keeps retrying the producer's address after losing it (for --resume)."""
    stop_timeout_s: float = field(
        default=90.0,
        metadata=flag(
            "--stop-timeout",
            "Seconds a SIGTERM or Ctrl-C drain (finish the step, checkpoint, leave) may take before the "
            "launch and its workers exit hard (default 90; keep it under the grace period of Slurm, "
            "Kubernetes or systemd).",
            resume=True,
        ),
    )
    """Bound on a drain: past it the process stops hard (workers killed, the run dir released), saying so."""
    preempt_signal: str = field(
        default="USR1",
        metadata=flag(
            "--preempt-signal",
            "Signal that means 'preemption soon': checkpoint at once and train on (default USR1, as "
            "Slurm's --signal=B:USR1@120 sends; off: none).",
            resume=True,
        ),
    )
    """A signal name (USR1, USR2, HUP, ...) or "off"; SIGINT/SIGTERM drain and cannot be chosen."""
    wire_dtype: Literal["bf16", "fp8"] = field(
        default="bf16",
        metadata=flag(
            "--wire-dtype",
            "Features on the wire: bf16 (the target's dtype) or fp8 (e4m3 + a scale per token and layer).",
        ),
    )
    """Features on the wire: "bf16" keeps the target's dtype; "fp8" sends float8_e4m3fn with one fp32 scale
    per token and layer (about half the bytes of bf16), dequantised on the worker's device."""
    payload_path: Literal["auto", "socket", "shm", "cuda_ipc"] = field(
        default="auto",
        metadata=flag(
            "--payload-path",
            "auto: GPU memory (CUDA IPC) or shared memory for same-host workers, frames for the rest "
            "(default); socket; shm only; cuda_ipc only.",
            resume=True,
        ),
    )
    """How BATCH payloads travel: "socket" as frames; "shm" through a shared-memory ring (same-host workers
    only; others are refused); "cuda_ipc" through a ring in the target GPU's memory that same-host CUDA
    workers open with CUDA IPC (others are refused; one that cannot open it gets frames); "auto": the CUDA
    IPC ring for same-host CUDA workers when the target runs on CUDA, else the shared-memory ring for
    same-host workers, frames for the rest."""
    frame_bytes: int = 1 << 20
    """Frame size for tensors sent on the socket (measured fastest by `dflash-pipe bench transport`)."""

    def __post_init__(self) -> None:
        from dflash_pipe.wire.codec import MIN_FRAME_BYTES  # torch: not at import (the CLI reads this module)

        check_choice(self, "wire_dtype", "wire.wire_dtype")
        check_choice(self, "payload_path", "wire.payload_path")
        if self.frame_bytes < MIN_FRAME_BYTES:
            raise ValueError(
                f"wire.frame_bytes must be >= {MIN_FRAME_BYTES} (64 KiB), got {self.frame_bytes}; "
                "the default (1 MiB) is the fastest measured."
            )

        if self.keys is not None:
            self.keys = Path(self.keys)
        require_keys_for(self.bind, self.keys)
        if self.ready_batches < 1 or self.worker_credits < 1:
            raise ValueError("wire.ready_batches and wire.worker_credits must be >= 1.")
        if self.reconnect_timeout_s < 0:
            raise ValueError(
                f"wire.reconnect_timeout_s must be >= 0 (0: exit at once), got {self.reconnect_timeout_s}."
            )
        if self.stop_timeout_s <= 0:
            raise ValueError(f"wire.stop_timeout_s (--stop-timeout) must be > 0, got {self.stop_timeout_s}.")
        from dflash_pipe.run.signals import parse_preempt_signal

        self.preempt_signal = parse_preempt_signal(self.preempt_signal)
        if not 0 < self.heartbeat_s < self.peer_timeout_s:
            raise ValueError(
                f"wire.heartbeat_s ({self.heartbeat_s}) must be > 0 and below wire.peer_timeout_s "
                f"({self.peer_timeout_s})."
            )


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run_dir: Path = field(
        metadata=flag("--run-dir", "Where config, metrics, logs and checkpoints go (default: runs/<time>).")
    )
    target_model: Path | None = field(
        default=None,
        metadata=flag(
            "--target-model",
            "HF model directory of the target, or a GGUF file (converted once to a cached HF folder; "
            "default: the built-in demo target).",
        ),
    )
    """HF model directory or GGUF file (``target.gguf``: converted once to a cached HF folder, which the run's
    checkpoints record beside the file); None runs the embedded demo target."""
    data: DataConfig
    regen: RegenConfig = field(default_factory=RegenConfig)
    """How the target regenerates the assistant turns (used with ``data.responses = "target"``)."""
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    train: TrainConfig = field(default_factory=TrainConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    eval_samples: int = field(
        default=16, metadata=flag("--eval-samples", "Held-out samples for tau (default 16).")
    )
    """Held-out samples used for the acceptance (tau) evaluation; 0 disables it."""
    compile_cache: Path | None = None
    """Shared torch.compile cache dir; None means RUN_DIR/compile-cache."""
    log: tuple[str, ...] = field(
        default=("jsonl",),
        metadata=flag(
            "--log",
            "Metrics sinks besides metrics.jsonl: tensorboard, wandb; repeat or comma-separate for several.",
            resume=True,
            multiple=True,
            metavar="SINK",
        ),
    )
    """Metrics sinks: jsonl (always written), tensorboard (RUN_DIR/tensorboard/), wandb; several at once."""

    def __post_init__(self) -> None:
        from dflash_pipe.telemetry.metrics import SINK_KINDS

        self.log = tuple(dict.fromkeys(["jsonl", *self.log]))
        bad = [k for k in self.log if k not in SINK_KINDS]
        if bad:
            raise ValueError(f"log: unknown metrics sink(s) {bad}; choose from {', '.join(SINK_KINDS)}.")
        self.run_dir = Path(self.run_dir)
        if self.target_model is not None:
            self.target_model = Path(self.target_model)
        if self.eval_samples < 0:
            raise ValueError(f"eval_samples must be >= 0, got {self.eval_samples}.")
        if self.wire.payload_path == "cuda_ipc" and self.layout.device != "cuda":
            raise ValueError(
                "wire.payload_path cuda_ipc needs the target and the drafters on CUDA (--device cuda); "
                "use auto, shm or socket on CPU."
            )

    @property
    def cache_dir(self) -> Path:
        return self.compile_cache or self.run_dir / COMPILE_CACHE_DIR

    def first_step_note(self) -> str:
        """When the first step comes under ``--min-workers`` (the dry run's plan, the launch's note)."""
        need, here = self.train.min_workers, self.layout.num_workers
        line = f"once {need} drafters are in the group (--min-workers {need}); this launch starts {here}"
        if need > here:
            line += (
                ": the others attach (`dflash-pipe producer --connect` on other nodes, or `dflash-pipe worker "
                "--connect`)"
            )
        return line

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        data = dict(data)
        parts = {
            "data": DataConfig,
            "regen": RegenConfig,
            "drafter": DrafterOptions,
            "train": TrainConfig,
            "wire": WireConfig,
            "layout": LayoutConfig,
        }
        for key, kind in parts.items():
            if key in data:
                data[key] = build(kind, data[key], key)
        return build(cls, data, "run")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
