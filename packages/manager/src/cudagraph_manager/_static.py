"""Static inputs: what the model reads, described once, kept in fixed buffers.

A CUDA graph reads its inputs from the addresses it was captured with, so each
model input gets one buffer, allocated once and refilled in place every step.
``StaticInput`` says how that buffer is shaped and padded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final, Literal, TypeAlias

import torch

#: Which batch count an input's (or an output's) leading dimension follows:
#: ``"tokens"`` (num_tokens), ``"reqs"`` (num_reqs) or ``None`` (not batched).
Rows: TypeAlias = Literal["tokens", "reqs"] | None

ROWS_VALUES: Final[tuple[Rows, ...]] = ("tokens", "reqs", None)


@dataclasses.dataclass(frozen=True, slots=True)
class StaticInput:
    """One model input: trailing shape, dtype, which rows it has, and its padding.

    The static buffer is ``[max rows, *shape]``: ``capture_sizes.max`` rows for
    ``rows="tokens"``, ``max_num_seqs`` rows for ``rows="reqs"``; an input with
    ``rows=None`` is not batched and its buffer is exactly ``shape``. A graph
    padded past the real batch reads ``pad_value`` in the extra rows (pick a
    value the model treats as inert: index 0, a scale of 1, a length of 0).
    Invalid values raise ``ValueError`` naming the field.
    """

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    rows: Rows = "tokens"
    pad_value: int | float = 0

    def __post_init__(self) -> None:
        # Checked at run time: callers may not be typed.
        shape: object = self.shape
        if isinstance(shape, list):
            shape = tuple(shape)
        if not isinstance(shape, tuple) or not all(_is_int(d) and d >= 1 for d in shape):
            raise ValueError(
                f"shape: expected a tuple of integers >= 1 (the trailing dims), got {self.shape!r}"
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))  # torch.Size -> plain tuple
        dtype: object = self.dtype
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {self.dtype!r}")
        if self.rows not in ROWS_VALUES:
            raise ValueError(f"rows: expected 'tokens', 'reqs' or None, got {self.rows!r}")
        _check_pad_value(self.pad_value, dtype)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_pad_value(value: object, dtype: torch.dtype) -> None:
    """``value`` must be a number that ``dtype`` holds exactly (no overflow, no rounding to int)."""
    if not isinstance(value, (int, float)):
        raise ValueError(f"pad_value: expected an int or a float, got {value!r}")
    if dtype.is_floating_point or dtype.is_complex:
        limit = torch.finfo(dtype).max
        if math.isfinite(value) and abs(value) > limit:
            raise ValueError(f"pad_value: {value!r} overflows {dtype} (largest magnitude {limit})")
        return
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"pad_value: {value!r} is not an integer, but dtype is {dtype}")
    if dtype is torch.bool:
        if value not in (0, 1):
            raise ValueError(f"pad_value: expected 0/1 or a bool for dtype torch.bool, got {value!r}")
        return
    try:
        info = torch.iinfo(dtype)
    except TypeError:
        raise ValueError(f"dtype: {dtype} has no fill value semantics (not a float, int or bool)") from None
    if not info.min <= value <= info.max:
        raise ValueError(f"pad_value: {value!r} is out of range for {dtype} [{info.min}, {info.max}]")
