"""Per-descriptor segment counts of the breakable wrapper, and outputs valid at capture."""

from __future__ import annotations

import pytest
import torch

from cudagraph_capture import BreakableCUDAGraphWrapper, eager_break_during_capture
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from tests.torch_support import rel_err

pytestmark = pytest.mark.gpu


@eager_break_during_capture
def _triple_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 3)


def _body(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    _triple_into(x + 1, buf)  # graph, break, graph
    return buf * 2


def test_capture_for_reports_the_segments_of_each_descriptor() -> None:
    """One break: two graphs for the key that was captured, nothing for one that was not."""
    wrapper = BreakableCUDAGraphWrapper(_body)
    x = torch.randn(64, device="cuda")
    buf = torch.empty(64, device="cuda")
    key, other = BatchDescriptor(64), BatchDescriptor(32)
    assert wrapper.capture_for(key) is None
    with set_forward_context(CUDAGraphMode.PIECEWISE, key):
        first = wrapper(x, buf)
    # The segments ran as they were captured: the capture's own output is the real result.
    assert rel_err(first, (x + 1) * 6) < 1e-6
    capture = wrapper.capture_for(key)
    assert capture is not None
    assert (capture.num_graphs, capture.num_eager_breaks) == (2, 1)
    assert wrapper.capture_for(other) is None
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        with set_forward_context(CUDAGraphMode.PIECEWISE, key):
            out = wrapper(x, buf)
        assert rel_err(out, (x + 1) * 6) < 1e-6
