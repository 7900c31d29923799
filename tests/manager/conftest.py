"""Fixtures shared by the manager's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from .helpers import BACKENDS, Backend, highest_fp32_matmul_precision


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Each test on the CPU (fake engines) and on CUDA (the real engines, full-fp32 matmuls), seeded."""
    torch.manual_seed(0)
    chosen = Backend.of(str(request.param))
    if chosen.device.type == "cuda":
        with highest_fp32_matmul_precision():
            yield chosen
    else:
        yield chosen
