"""The one run configuration: every part's config composed, validated at the edge, saved in the run dir."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash_pipe.data import DataConfig
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.train.config import TrainConfig


@dataclass(kw_only=True, slots=True)
class DrafterOptions:
    """What the user chooses about the drafter; the rest is derived from the target's config."""

    preset: str | None = None
    """A published drafter's shape (docs/drafter.md): sets num_layers, block_size, layer_types and
    sliding_window, each still overridable; widths always follow the target."""
    num_layers: int = 5
    block_size: int = 16
    layer_types: tuple[str, ...] | None = None
    """One per draft layer: full_attention or sliding_attention (comma-separated on the command line;
    full/sliding for short). None: all full_attention."""
    sliding_window: int | None = None
    """Keys a sliding_attention layer sees, the query included (e.g. 2048); only with sliding layers."""
    mask_token_id: int | None = None
    """None: a reserved token of the tokenizer (e.g. <|mask|>), or an error saying to set it."""
    target_layer_ids: tuple[int, ...] | None = None
    """None: the even-spread rule of the DFlash reference."""
    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    max_anchors: int = 512

    def __post_init__(self) -> None:
        if self.target_layer_ids is not None:
            self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}.")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {self.block_size}.")
        if self.attention_backend not in ("auto", "flex", "sdpa"):
            raise ValueError(
                f"drafter.attention_backend must be auto, flex or sdpa, got {self.attention_backend!r}."
            )
        if self.max_anchors < 1:
            raise ValueError(f"drafter.max_anchors must be >= 1, got {self.max_anchors}.")
        from dflash_pipe.drafter.config import check_layer_types
        from dflash_pipe.drafter.presets import PRESETS

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
    bind: str = "tcp://127.0.0.1:0"
    """Producer address; port 0 picks a free one. Anything but loopback or ipc:// needs `keys`."""
    keys: Path | None = None
    """CURVE key directory (`dflash-pipe keys generate DIR`): workers must hold its client key to connect."""
    ready_batches: int = 4
    """Batches of features the producer keeps computed ahead of demand (host memory bound)."""
    worker_credits: int = 2
    """Batches each worker may hold at once (one training, the rest in flight)."""
    heartbeat_s: float = 2.0
    peer_timeout_s: float = 120.0
    """A peer silent this long is declared dead (covers a cold torch.compile)."""
    join_timeout_s: float = 600.0
    """How long the producer waits for all launched workers to say HELLO."""
    reconnect_timeout_s: float = 300.0
    """How long a launched worker keeps retrying the producer's address after losing it (for --resume)."""
    wire_dtype: Literal["bf16", "fp8"] = "bf16"
    """Features on the wire: "bf16" keeps the target's dtype; "fp8" sends float8_e4m3fn with one fp32 scale
    per token and layer (about half the bytes of bf16), dequantised on the worker's device."""
    payload_path: Literal["auto", "socket", "shm", "cuda_ipc"] = "auto"
    """How BATCH payloads travel: "socket" as frames; "shm" through a shared-memory ring (same-host workers
    only; others are refused); "cuda_ipc" through a ring in the target GPU's memory that same-host CUDA
    workers open with CUDA IPC (others are refused; one that cannot open it gets frames); "auto": the CUDA
    IPC ring for same-host CUDA workers when the target runs on CUDA, else the shared-memory ring for
    same-host workers, frames for the rest."""
    frame_bytes: int = 1 << 20
    """Frame size for tensors sent on the socket (measured fastest by `dflash-pipe bench transport`)."""

    def __post_init__(self) -> None:
        from dflash_pipe.wire.addresses import require_keys_for
        from dflash_pipe.wire.codec import MIN_FRAME_BYTES

        if self.wire_dtype not in ("bf16", "fp8"):
            raise ValueError(f"wire.wire_dtype must be bf16 or fp8, got {self.wire_dtype!r}.")
        if self.payload_path not in ("auto", "socket", "shm", "cuda_ipc"):
            raise ValueError(
                f"wire.payload_path must be auto, socket, shm or cuda_ipc, got {self.payload_path!r}."
            )
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
        if not 0 < self.heartbeat_s < self.peer_timeout_s:
            raise ValueError(
                f"wire.heartbeat_s ({self.heartbeat_s}) must be > 0 and below wire.peer_timeout_s "
                f"({self.peer_timeout_s})."
            )


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run_dir: Path
    target_model: Path | None = None
    """HF model directory; None runs the embedded demo target."""
    data: DataConfig
    regen: RegenConfig = field(default_factory=RegenConfig)
    """How the target regenerates the assistant turns (used with ``data.responses = "target"``)."""
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    train: TrainConfig = field(default_factory=TrainConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    eval_samples: int = 16
    """Held-out samples used for the acceptance (tau) evaluation; 0 disables it."""
    compile_cache: Path | None = None
    """Shared torch.compile cache dir; None means RUN_DIR/compile-cache."""
    log: tuple[str, ...] = ("jsonl",)
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
        return self.compile_cache or self.run_dir / "compile-cache"

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
                data[key] = _build(kind, data[key], key)
        return _build(cls, data, "run")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _build(kind: type, values: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"Unknown {where} config key(s) {unknown}; valid keys are {sorted(names)}.")
    return kind(**values)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
