import pytest

from dflash_pipe.run.layout import LayoutConfig, parse_gpu_spec


@pytest.mark.parametrize(
    ("spec", "ids"),
    [("0-4", (0, 1, 2, 3, 4)), ("5,6,7", (5, 6, 7)), ("0,2-3", (0, 2, 3)), ("6", (6,)), (" 1 , 3 ", (1, 3))],
)
def test_parses_ranges_and_lists(spec, ids):
    assert parse_gpu_spec(spec) == ids


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("", "empty"),
        ("a", "not a GPU id"),
        ("3-1", "backwards"),
        ("0,0", "more than once"),
        ("1,", "empty"),
        ("-1", "not a GPU id"),
    ],
)
def test_rejects_bad_specs_with_the_flag_name(spec, why):
    with pytest.raises(ValueError, match=why) as err:
        parse_gpu_spec(spec, flag="--drafter-gpus")
    assert "--drafter-gpus" in str(err.value)


def test_validates_ids_against_the_machine_and_reports_overlap():
    layout = LayoutConfig(device="cuda", target_gpus=(0, 1), drafter_gpus=(1, 8))
    with pytest.raises(ValueError, match=r"\[8\] do not exist"):
        layout.validate_against(8)
    shared = LayoutConfig(device="cuda", target_gpus=(0, 1), drafter_gpus=(1,))
    shared.validate_against(2)  # sharing is allowed
    assert shared.shared_gpus() == [1]
    assert LayoutConfig(device="cpu").shared_gpus() == []
    with pytest.raises(ValueError, match="--device cpu"):
        layout.validate_against(0)


def test_cpu_layout_devices():
    layout = LayoutConfig(device="cpu", cpu_workers=3)
    assert layout.worker_devices() == ["cpu"] * 3 and layout.num_workers == 3
    with pytest.raises(ValueError, match="target-gpus"):
        LayoutConfig(device="cuda")
