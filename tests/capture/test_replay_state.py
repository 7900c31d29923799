"""Replay of a breakable capture that has nothing to replay, and replay of a key that is not one (issue 39).

``BreakableCUDAGraphCapture.replay()`` before a capture completed (never
entered, still capturing, failed) raises ``RuntimeError`` saying so; before,
it ran nothing and returned, so a caller's outputs silently kept stale
values. A wrapper's ``replay`` of a valid key never captured stays a
``KeyError``; of anything else, a ``ValueError`` naming ``descriptor``.
"""

from __future__ import annotations

import pytest
import torch

from cudagraph_capture import (
    BreakableCUDAGraphCapture,
    BreakableCUDAGraphWrapper,
    CaptureError,
    CUDAGraphWrapper,
)
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from tests.capture.helpers import cuda


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def test_replay_before_any_capture_raises() -> None:
    """A capture never entered has nothing to replay: ``RuntimeError``, on any machine."""
    capture = BreakableCUDAGraphCapture()
    with pytest.raises(
        RuntimeError, match=r"^BreakableCUDAGraphCapture\.replay\(\): nothing to replay, no capture"
    ):
        capture.replay()
    assert capture.num_graphs == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a capture refused for want of CUDA")
def test_replay_after_a_capture_refused_without_cuda_raises() -> None:
    """Entering without CUDA raises ``CaptureError``; the capture still has nothing to replay."""
    capture = BreakableCUDAGraphCapture()
    with pytest.raises(CaptureError, match="needs a CUDA device"), capture:
        pass
    with pytest.raises(RuntimeError, match="nothing to replay, no capture has completed"):
        capture.replay()


@pytest.mark.parametrize(
    "wrapper",
    [CUDAGraphWrapper(_identity, CUDAGraphMode.FULL), BreakableCUDAGraphWrapper(_identity)],
    ids=["monolithic", "breakable"],
)
def test_wrapper_replay_of_a_key_never_captured_is_a_key_error(
    wrapper: CUDAGraphWrapper[..., object],
) -> None:
    """A ``BatchDescriptor`` never captured: ``KeyError`` naming it; not captured, no entry made."""
    with pytest.raises(KeyError, match=r"no graph captured for BatchDescriptor\(num_tokens=8"):
        wrapper.replay(BatchDescriptor(8))
    assert not wrapper.is_captured(BatchDescriptor(8))
    assert wrapper.num_captured == 0


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
def test_replay_while_capturing_and_after_a_failed_capture_raises() -> None:
    """Inside its own capture, and after the body raised, replay refuses; after a good capture it runs."""
    x = torch.zeros(16, device=cuda())
    capture = BreakableCUDAGraphCapture()

    def body() -> None:
        with capture:
            x.add_(1.0)
            with pytest.raises(RuntimeError, match="nothing to replay, no capture has completed"):
                capture.replay()
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        body()
    with pytest.raises(RuntimeError, match="nothing to replay, the capture failed"):
        capture.replay()
    good = BreakableCUDAGraphCapture()
    with good:
        x.add_(1.0)
    before = x.clone()
    good.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before + 1.0)
