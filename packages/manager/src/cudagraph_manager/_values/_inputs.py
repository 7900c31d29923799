"""The model's inputs, declared: what the model reads, described once, kept in fixed buffers.

A CUDA graph reads its inputs from the addresses it was captured with, so each
model input gets one buffer, allocated once and refilled in place every step.
``StaticInput`` says how that buffer is shaped and padded; the checks of what
a caller declares are here too (a pad value, the mapping of inputs, and
``signature_of``: how a callable the caller passes will be called).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Final, Literal, TypeAlias, cast

import torch

from cudagraph_dispatch.lowlevel import check_int

_INTEGER_DTYPES: Final = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}
)

#: Which batch count an input's (or an output's) leading dimension follows:
#: ``"tokens"`` (num_tokens), ``"reqs"`` (num_reqs) or ``None`` (not batched).
Rows: TypeAlias = Literal["tokens", "reqs"] | None


#: Keyword arguments of ``run`` itself: no model input may be named so.
RESERVED_NAMES: Final = frozenset({"uniform_decode", "num_active_loras", "invalid_modes"})

#: The largest size of a tensor dimension torch can hold (int64).
_MAX_DIM: Final = 2**63 - 1


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
        try:
            if not isinstance(shape, (tuple, list, torch.Size)):
                raise ValueError
            dims = tuple(check_int("shape", d, minimum=1) for d in shape)
        except ValueError:
            raise ValueError(
                f"shape: expected a tuple of integers >= 1 (the trailing dims), got {self.shape!r}"
            ) from None
        if any(d > _MAX_DIM for d in dims):
            raise ValueError(f"shape: a dim above 2**63 - 1 (torch's largest size), got {dims!r:.80}")
        object.__setattr__(self, "shape", dims)  # a list or torch.Size -> a plain tuple
        _check_dtype(self.dtype)
        if self.rows not in ("tokens", "reqs", None):
            raise ValueError(f"rows: expected 'tokens', 'reqs' or None, got {self.rows!r}")
        check_pad_value(self.pad_value, self.dtype)


def _check_dtype(dtype: object) -> None:
    """A dtype whose buffers can be filled and copied: floating, integer or bool."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
    if dtype.is_floating_point or dtype is torch.bool or dtype in _INTEGER_DTYPES:
        return
    raise ValueError(
        f"dtype: expected a floating, integer or bool torch.dtype, got {dtype} "
        "(complex and quantized inputs are not supported)"
    )


def check_pad_value(value: object, dtype: torch.dtype) -> None:
    """``value`` must be a finite number that ``dtype`` holds exactly (no overflow, no rounding)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"pad_value: expected an int or a float, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"pad_value: expected a finite number (padding rows must stay inert), got {value!r}")
    if dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        if abs(value) > limit:
            raise ValueError(f"pad_value: {value!r} overflows {dtype} (largest magnitude {limit})")
        return
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"pad_value: {value!r} is not an integer, but dtype is {dtype}")
    if dtype is torch.bool:
        if value not in (0, 1):
            raise ValueError(f"pad_value: expected 0 or 1 for dtype torch.bool, got {value!r}")
        return
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        raise ValueError(f"pad_value: {value!r} is out of range for {dtype} [{info.min}, {info.max}]")


def check_inputs_spec(inputs: Mapping[str, StaticInput]) -> dict[str, StaticInput]:
    """The declared inputs, validated: names usable as keywords, at least one "tokens" input."""
    given: object = inputs
    if not isinstance(given, Mapping) or not given:
        raise ValueError(f"inputs: expected a non-empty mapping of names to StaticInput, got {inputs!r}")
    checked: dict[str, StaticInput] = {}
    for name, spec in inputs.items():
        given_name: object = name  # checked at run time: callers may not be typed
        if not isinstance(given_name, str) or not given_name.isidentifier():
            raise ValueError(f"inputs: names are passed as keywords, so must be identifiers, got {name!r}")
        if name in RESERVED_NAMES:
            raise ValueError(f"inputs[{name!r}]: the name is a keyword of run() itself; rename the input")
        if not isinstance(spec, StaticInput):
            raise ValueError(f"inputs[{name!r}]: expected a StaticInput, got {spec!r}")
        checked[name] = spec
    if not any(spec.rows == "tokens" for spec in checked.values()):
        raise ValueError(
            "inputs: at least one input needs rows='tokens': its row count is the batch's num_tokens"
        )
    return checked


def signature_of(call: object) -> inspect.Signature | None:
    """``call``'s signature, checked against how it will be called; ``None`` where none can be read.

    A builtin may have no signature to read: its first call says what is wrong.
    """
    try:
        return inspect.signature(cast("Callable[..., object]", call))
    except (TypeError, ValueError):
        return None
