"""The manager after things went wrong: a failed capture, caller edits, stale buffers.

GPU only: each case is about what the real engines and the shared pool do.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch
from torch import nn

from cudagraph_capture import (
    CaptureError,
    CaptureInvalidatedError,
    CUDAGraphWrapper,
    eager_break_during_capture,
)
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_manager import CUDAGraphManager, StaticInput
from tests.torch_support import rel_err

pytestmark = pytest.mark.gpu

DIM: Final = 16
SIZES: Final = (2, 4, 8)
PAD: Final = -3.0
INPUTS: Final = {"x": StaticInput((DIM,), torch.float32, "tokens", pad_value=PAD)}


def _config(mode: CUDAGraphMode) -> DispatchConfig:
    return DispatchConfig(mode, CaptureSizes(SIZES), max_num_seqs=8)


class _SyncsOnce(nn.Module):
    """``x * w``; while ``sync_in_capture`` is set, reads a value back during a capture (illegal)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, device="cuda"), requires_grad=False)
        self.sync_in_capture = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sync_in_capture and torch.cuda.is_current_stream_capturing():
            float(x.sum().item())  # a host sync: invalidates the capture
        return x * self.w


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE], ids=lambda m: m.name)
def test_capture_can_be_retried_after_an_invalidated_capture(mode: CUDAGraphMode) -> None:
    """A capture that CUDA invalidated names its key; a second capture() then captures everything.

    Its type says so (``CaptureInvalidatedError``: worth a retry), raised from the sync's own error.
    """
    model = _SyncsOnce()
    manager = CUDAGraphManager(model, INPUTS, _config(mode))
    with pytest.raises(CaptureInvalidatedError, match="num_tokens=8") as raised:  # largest first
        manager.capture()
    assert raised.value.__cause__ is not None
    assert manager.num_captured == 0
    probe = torch.randn(5, DIM, device="cuda")
    assert torch.equal(manager.run(x=probe), probe * model.w)  # still usable: runs eagerly
    model.sync_in_capture = False
    manager.capture()
    assert manager.num_captured == len(SIZES)
    for n in (1, 3, 8):
        x = torch.randn(n, DIM, device="cuda")
        before = manager.stats.replays_of(mode)
        out = manager.run(x=x)
        assert manager.stats.replays_of(mode) == before + 1
        assert rel_err(out, x * model.w) < 1e-6


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, device="cuda"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": x * self.w, "b": x + self.w}


def test_a_caller_editing_the_output_dict_does_not_change_the_next_step() -> None:
    """Each run hands back its own dict: popping a key does not remove it from later steps."""
    model = _DictModel()
    manager = CUDAGraphManager(model, INPUTS, _config(CUDAGraphMode.FULL))
    manager.capture()
    x = torch.randn(4, DIM, device="cuda")
    first = manager.run(x=x)
    first.pop("a")
    for _ in range(2):
        again = manager.run(x=x)
        assert set(again) == {"a", "b"}
        assert rel_err(again["a"], x * model.w) < 1e-6


class _Recorder(nn.Module):
    """Records, outside any capture, the smallest input value each eager run sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _record(self.seen, x)
        return x * 2


@eager_break_during_capture
def _record(seen: list[float], x: torch.Tensor) -> None:
    if not torch.cuda.is_current_stream_capturing():
        seen.append(float(x.max().item()))


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE], ids=lambda m: m.name)
def test_capture_after_runs_reads_pad_values_not_the_last_batch(mode: CUDAGraphMode) -> None:
    """Warm-up and breakable capture run the model for real: on pad values, never on live data."""
    model = _Recorder()
    manager = CUDAGraphManager(model, INPUTS, _config(mode))
    manager.capture()
    manager.run(x=torch.full((8, DIM), 100.0, device="cuda"))  # the buffers now hold a real batch
    manager.clear()
    model.seen.clear()
    manager.capture()
    assert model.seen, "the capture ran no eager work: the test proves nothing"
    assert max(model.seen) == PAD


def test_a_graph_that_records_no_cuda_work_is_refused() -> None:
    """A runnable that works on the CPU captures nothing: CaptureError, not stale outputs forever."""
    wrapper = CUDAGraphWrapper(lambda t: t * 2, CUDAGraphMode.FULL)
    cpu = torch.randn(4)
    with (
        set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(4)),
        pytest.raises(CaptureError, match="no CUDA work"),
    ):
        wrapper(cpu)
    assert wrapper.num_captured == 0


def test_a_cpu_manager_beside_cuda_captures_nothing_and_says_why() -> None:
    """``device="cpu"`` on a GPU machine: the default engines are not built, nothing is captured."""
    manager = CUDAGraphManager(_Recorder(), INPUTS, _config(CUDAGraphMode.FULL), device="cpu")
    report = manager.capture()
    assert report.num_graphs == 0
    assert manager.num_captured == 0
    assert report.no_graphs == "CUDA graphs need a CUDA device, and the manager's device is cpu"
