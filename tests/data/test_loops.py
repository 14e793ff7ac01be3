"""What counts as a reply that ends in a loop (``data.loops``)."""

from __future__ import annotations

import random

import pytest

from dflash_pipe.data.loops import LOOP_MAX_PERIOD, LOOP_MIN_TOKENS, ends_in_loop, loop_period


def _varied(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50_000) for _ in range(n)]


@pytest.mark.parametrize("period", [1, 2, 7, 40, LOOP_MAX_PERIOD])
def test_a_unit_repeated_to_the_end_is_a_loop_of_its_period(period):
    unit = _varied(period, seed=period)
    tokens = _varied(50) + unit * max(3, LOOP_MIN_TOKENS // period + 1)
    assert loop_period(tokens) == period


def test_the_smallest_period_is_reported():
    assert loop_period(_varied(10) + [5, 6] * 30) == 2  # also periodic with 4, 6, ...


def test_a_loop_cut_mid_unit_still_counts():
    tokens = _varied(20) + [1, 2, 3, 4, 5] * 10 + [1, 2]
    assert loop_period(tokens) == 5


def test_varied_text_repetition_earlier_or_too_short_is_no_loop():
    assert loop_period(_varied(600)) is None
    assert loop_period([7] * 40 + _varied(60)) is None  # the loop was left: the reply moved on
    assert loop_period(_varied(10) + [3] * (LOOP_MIN_TOKENS - 1)) is None  # "......" is not a loop
    assert loop_period([3] * (LOOP_MIN_TOKENS - 1)) is None
    assert loop_period([]) is None


def test_a_long_unit_needs_three_repeats():
    unit = _varied(60, seed=1)
    assert loop_period(_varied(5) + unit * 2) is None
    assert loop_period(_varied(5) + unit * 3) == 60
    assert loop_period(_varied(5) + _varied(LOOP_MAX_PERIOD + 1, seed=2) * 3) is None  # past the bound


def test_numbered_items_are_not_an_exact_repetition():
    tokens = [t for i in range(20) for t in (100 + i, 5, 6, 7)]  # "1. a b c 2. a b c ..."
    assert not ends_in_loop(tokens)
    assert ends_in_loop([t for _ in range(20) for t in (100, 5, 6, 7)])


def test_bounds_are_arguments():
    assert loop_period([1, 2] * 3, min_tokens=6) == 2
    assert loop_period([1, 2] * 3, min_tokens=6, min_repeats=4) is None
    assert loop_period([9] * 30 + [1, 2, 3] * 3, max_period=2, min_tokens=9) is None
