"""Replicas when the target fits a GPU, a layer split when it does not; a split target gives the same
features as an unsplit one."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.target import TargetCore
from dflash_pipe.target.placement import HEADROOM, plan_replicas, weight_bytes
from tests.target.inputs import packed_batch

GIB = 1 << 30


def test_replicas_when_the_weights_fit_each_gpu():
    groups = plan_replicas(["cuda:0", "cuda:1"], weights=16 * GIB, memory=lambda d: 141 * GIB)
    assert groups == [["cuda:0"], ["cuda:1"]]


def test_one_split_replica_when_they_do_not():
    devices = ["cuda:0", "cuda:1", "cuda:2"]
    groups = plan_replicas(devices, weights=140 * GIB, memory=lambda d: 141 * GIB)
    assert groups == [devices]
    assert plan_replicas(["cuda:0"], weights=140 * GIB, memory=lambda d: 141 * GIB) == [["cuda:0"]]


def test_explicit_modes_and_headroom():
    devices = ["cuda:0", "cuda:1"]
    almost = int(100 * GIB / HEADROOM) + 1  # fits raw, not with headroom
    assert plan_replicas(devices, weights=almost, memory=lambda d: 100 * GIB) == [devices]
    assert plan_replicas(devices, weights=almost, memory=lambda d: 100 * GIB, mode="replicas") == [
        ["cuda:0"],
        ["cuda:1"],
    ]
    assert plan_replicas(devices, weights=1, memory=lambda d: 100 * GIB, mode="split") == [devices]
    with pytest.raises(ValueError, match="--target-parallel"):
        plan_replicas(devices, weights=1, memory=lambda d: 1, mode="pipeline")


def test_weight_bytes_from_the_config(qwen3_dir):
    loaded = sum(p.numel() for p in TargetCore(qwen3_dir, [0], "cpu", torch.float32).model.parameters())
    assert weight_bytes(qwen3_dir, torch.bfloat16) == pytest.approx(loaded * 2, rel=0.05)


def split_devices() -> list[str]:
    """A real two-device split where a GPU exists; otherwise the same code path on cpu twice."""
    return ["cuda:0", "cpu"] if torch.cuda.is_available() else ["cpu", "cpu"]


def test_split_target_gives_the_same_features_and_greedy(model_dir):
    layer_ids = (1, 3)
    lengths = [5, 9, 3]
    ids = packed_batch(lengths)
    whole = TargetCore(model_dir, layer_ids, "cpu", torch.float32)
    split = TargetCore(model_dir, layer_ids, split_devices(), torch.float32)
    assert {p.device.type for p in split.layers[-1].parameters()} == {"cpu"}
    torch.testing.assert_close(split.features(ids, lengths).cpu(), whole.features(ids, lengths))
    assert torch.equal(split.greedy_next(ids, lengths).cpu(), whole.greedy_next(ids, lengths))
