"""Fixtures shared by the capture engine's GPU tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from cudagraph_capture import BreakableCUDAGraphCapture, set_capture_enabled
from tests.torch_support import highest_fp32_matmul_precision


@pytest.fixture
def clean_capture_state() -> Iterator[None]:
    """Seeded, capture enabled, full-fp32 matmuls; afterwards capture is re-enabled
    whatever the test did, and no breakable capture may be left active."""
    torch.manual_seed(0)
    set_capture_enabled(True)
    with highest_fp32_matmul_precision():
        yield
    set_capture_enabled(True)
    torch.cuda.synchronize()
    assert BreakableCUDAGraphCapture.current() is None
