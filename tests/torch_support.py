"""Helpers shared by the torch-using tests (capture, manager, benchmarks)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64.

    The reference must not be all zeros: a zero reference would make any
    output look either perfect or infinitely wrong, and say nothing.
    """
    assert actual.shape == expected.shape, f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64)
    b = expected.detach().to(device=a.device, dtype=torch.float64)  # an oracle may be on the CPU
    denom = float(torch.linalg.vector_norm(b).item())
    assert denom > 0.0, "the reference is all zeros: the comparison would prove nothing"
    return float(torch.linalg.vector_norm(a - b).item()) / denom


def as_tensor(value: object) -> torch.Tensor:
    """``value``, checked to be a tensor (narrows ``Any``/``object`` results of module calls)."""
    assert isinstance(value, torch.Tensor), f"expected a tensor, got {type(value).__name__}"
    return value


@contextmanager
def highest_fp32_matmul_precision() -> Iterator[None]:
    """Run fp32 matmuls in full fp32 (no TF32), restoring the previous setting."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some torch versions warn about the TF32 knobs
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.set_float32_matmul_precision(previous)


@pytest.fixture(autouse=True)
def eager_flex_is_expected() -> Iterator[None]:
    """Eager FlexAttention (the CPU tests' reference path) warns that it is unfused; that is the point.

    An autouse fixture for the modules that import it (the paged decoder's tests).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
        yield
