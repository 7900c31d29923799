"""check_int and check_bool: the argument checks every package shares (their rejections: test_bad_inputs)."""

from __future__ import annotations

import enum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraph_dispatch.lowlevel import check_bool, check_int


class _Level(enum.IntEnum):
    LOW = 1
    HIGH = 7


@given(st.integers(min_value=-5, max_value=5), st.integers(min_value=-10, max_value=10))
def test_check_int_accepts_exactly_the_integers_at_or_above_the_minimum(minimum: int, value: int) -> None:
    """An int at or above the minimum comes back unchanged; one below it is a ValueError."""
    if value >= minimum:
        assert check_int("size", value, minimum=minimum) is value
    else:
        with pytest.raises(ValueError, match=f"size.*>= {minimum}.*{value}"):
            check_int("size", value, minimum=minimum)


def test_check_int_accepts_int_subclasses_but_not_bool() -> None:
    """An IntEnum is an integer; True and False are flags, never counts."""
    assert check_int("level", _Level.HIGH, minimum=1) is _Level.HIGH
    for flag in (True, False):
        with pytest.raises(ValueError, match=f"flag.*{flag}"):
            check_int("flag", flag, minimum=0)


@pytest.mark.parametrize("flag", [True, False])
def test_check_bool_returns_the_flag(flag: bool) -> None:
    """True and False pass through as themselves."""
    assert check_bool("uniform_decode", flag) is flag


@pytest.mark.parametrize("value", [0, 1, "", "False", None, 1.0, [True]])
def test_check_bool_rejects_truthy_and_falsy_stand_ins(value: object) -> None:
    """Only True and False are flags: ints, strings, None and lists are rejected, whatever their truth."""
    with pytest.raises(ValueError, match=r"uniform_decode: expected True or False"):
        check_bool("uniform_decode", value)
