"""The ``GraphEngine`` road: ``warm_up`` runs the model, ``record`` captures without running anything.

``record`` is what lets a model runner capture while another thread serves
from the same pool and buffers, so its promise is checked where it could
break: a recording must write no memory at all (a scratch buffer the model
writes in every forward keeps a poisoned value; an eager break is not
called; the outputs of an earlier replay, in pool memory the recording may
be handed, keep their values), and the entry it returns, kept by the caller
alone, must then replay like eager on fresh random inputs.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch
from torch.nn.functional import linear

from cudagraph_capture import (
    BreakableCUDAGraphCapture,
    BreakableCUDAGraphWrapper,
    CaptureOptions,
    CUDAGraphWrapper,
    capture_stream,
)
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, get_forward_context
from tests.capture.helpers import (
    DIM,
    FP32_TOL,
    Engine,
    MLPWithBreak,
    cuda,
    fill_fresh_,
    highest_fp32_matmul_precision,
    rel_err,
    sleep_gpu,
)

ENGINES: Final[tuple[Engine, ...]] = ("monolithic", "breakable")
#: A value no computation here produces: a scratch row still holding it was never written.
POISON: Final = -12345.0


class ScratchModel(MLPWithBreak):
    """``MLPWithBreak`` that also writes a scratch buffer of its own in every forward (a workspace)."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = torch.full((64, DIM), POISON, device=cuda())  # [max tokens, dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.scratch[: x.shape[0]]
        torch.mul(x, 2.0, out=rows)  # the workspace write
        return super().forward(rows) - x  # ... and its read: = x + W2 silu(W1 2x)


def _wrapper(
    engine: Engine, model: ScratchModel, options: CaptureOptions | None = None
) -> CUDAGraphWrapper[..., torch.Tensor] | BreakableCUDAGraphWrapper[..., torch.Tensor]:
    def runnable(*, x: torch.Tensor) -> torch.Tensor:
        return model.run(x)

    if engine == "monolithic":
        return CUDAGraphWrapper(runnable, CUDAGraphMode.FULL, options)
    return BreakableCUDAGraphWrapper(runnable, options)


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("engine", ENGINES)
def test_record_writes_nothing_and_the_entry_replays_like_eager(engine: Engine) -> None:
    model = ScratchModel()
    wrapper = _wrapper(engine, model)
    x_buf = torch.randn(16, DIM, device=cuda())
    with highest_fp32_matmul_precision(), torch.no_grad():
        model.run(x_buf)  # warm the kernels up outside the capture
        model.scratch.fill_(POISON)
        calls_before = model.silu.calls
        sleep_gpu()  # a recording that ran anything would queue it behind this and still write
        entry = wrapper.record(BatchDescriptor(16), {"x": x_buf})
        torch.cuda.synchronize()
        assert torch.all(model.scratch == POISON), "the recording wrote the model's scratch buffer"
        if engine == "breakable":
            assert model.silu.calls == calls_before, "the recording called the eager break"
        else:  # inside a FULL capture the break is a plain call: recorded into the graph, not run
            assert model.silu.capturing[calls_before:] == [True]
        assert not wrapper.is_captured(BatchDescriptor(16)), "record keeps nothing: the caller owns the entry"
        assert wrapper.num_captured == 0
        for _ in range(3):
            expected = model.run(fill_fresh_(x_buf)).clone()
            entry.replay()
            assert rel_err(entry.output, expected) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("engine", ENGINES)
def test_record_leaves_a_held_replay_output_intact(engine: Engine) -> None:
    """A smaller key recorded after a replay may get the replay's output memory: it must not write it."""
    model = ScratchModel()
    wrapper = _wrapper(engine, model)
    x_buf = torch.randn(32, DIM, device=cuda())
    with highest_fp32_matmul_precision(), torch.no_grad():
        model.run(x_buf)
        large = wrapper.record(BatchDescriptor(32), {"x": x_buf})
        expected = model.run(fill_fresh_(x_buf)).clone()
        large.replay()
        held = large.output  # the caller still reads this (a sampling step queued later, say)
        sleep_gpu()
        small = wrapper.record(BatchDescriptor(8), {"x": x_buf[:8]})
        torch.cuda.synchronize()
        assert rel_err(held, expected) < FP32_TOL, "recording the smaller key wrote the held output"
        expected_small = model.run(fill_fresh_(x_buf)[:8]).clone()
        small.replay()
        assert rel_err(small.output, expected_small) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
def test_a_breakable_entry_holds_its_segments_and_the_wrapper_keeps_none() -> None:
    model = ScratchModel()
    wrapper = _wrapper("breakable", model)
    x_buf = torch.randn(8, DIM, device=cuda())
    with torch.no_grad():
        model.run(x_buf)
        entry = wrapper.record(BatchDescriptor(8), {"x": x_buf})
    owner = entry.owner
    assert isinstance(owner, BreakableCUDAGraphCapture)
    assert (owner.num_graphs, owner.num_eager_breaks) == (2, 1)
    assert isinstance(wrapper, BreakableCUDAGraphWrapper)
    assert wrapper.capture_for(BatchDescriptor(8)) is None, "the entry is the one owner of its segments"


@pytest.mark.gpu
def test_the_capture_stream_is_no_stream_of_torchs_pool() -> None:
    """torch.cuda.Stream() cycles through 32 streams per priority: none of them may be the capture stream."""
    ours = capture_stream().cuda_stream
    taken = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(70)}  # type: ignore[no-untyped-call]  # untyped stubs
    assert ours not in taken


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("engine", ENGINES)
def test_warm_up_runs_the_model_eagerly_under_none(engine: Engine) -> None:
    seen: list[tuple[CUDAGraphMode | None, bool]] = []
    weight = torch.randn(DIM, DIM, device=cuda())

    def runnable(*, x: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        seen.append(
            (None if context is None else context.runtime_mode, torch.cuda.is_current_stream_capturing())
        )
        return linear(x, weight)

    options = CaptureOptions(warmup_runs=2)
    wrapper = (
        CUDAGraphWrapper(runnable, CUDAGraphMode.FULL, options)
        if engine == "monolithic"
        else BreakableCUDAGraphWrapper(runnable, options)
    )
    wrapper.warm_up(BatchDescriptor(4), {"x": torch.randn(4, DIM, device=cuda())})
    assert seen == [(CUDAGraphMode.NONE, False)] * 2
    assert wrapper.num_captured == 0


def test_record_and_warm_up_check_the_descriptor() -> None:
    wrapper = CUDAGraphWrapper(lambda **kw: kw, CUDAGraphMode.FULL)
    with pytest.raises(ValueError, match="descriptor: expected a BatchDescriptor, got 4"):
        wrapper.record(4, {})  # type: ignore[arg-type]  # the run-time check under test
    with pytest.raises(ValueError, match="descriptor: expected a BatchDescriptor, got 'x'"):
        wrapper.warm_up("x", {})  # type: ignore[arg-type]  # the run-time check under test
