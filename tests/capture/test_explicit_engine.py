"""The engines called directly: ``capture(descriptor, ...)``, ``is_captured``, ``replay``, ``discard``.

No forward context set and read back per step (``cudagraph_manager`` takes the
``GraphEngine`` road instead: ``test_record.py``). Every numeric check copies fresh ``randn`` data into the
static input, replays, and compares with eager on the same data. The last
tests need no GPU: the argument checks, and the error where there is no CUDA.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch

from cudagraph_capture import BreakableCUDAGraphWrapper, CaptureError, CUDAGraphWrapper
from cudagraph_capture._pool import capture_stream, shared_pool
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, ForwardContext, get_forward_context
from tests.capture.helpers import (
    DIM,
    FP32_TOL,
    SIZES,
    CallCounter,
    Engine,
    MLPWithBreak,
    cuda,
    fill_fresh_,
    rel_err,
)

ENGINES: Final[tuple[Engine, ...]] = ("monolithic", "breakable")
#: The forward-context mode each engine's explicit capture runs its runnable under.
CAPTURE_MODE: Final[dict[Engine, CUDAGraphMode]] = {
    "monolithic": CUDAGraphMode.FULL,
    "breakable": CUDAGraphMode.PIECEWISE,
}


def _engine(
    engine: Engine, runnable: CallCounter
) -> CUDAGraphWrapper[[torch.Tensor], torch.Tensor] | BreakableCUDAGraphWrapper[[torch.Tensor], torch.Tensor]:
    """The engine called directly, without a forward context."""
    if engine == "monolithic":
        return CUDAGraphWrapper(runnable, CUDAGraphMode.FULL)
    return BreakableCUDAGraphWrapper(runnable)


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("engine", ENGINES)
def test_explicit_capture_and_replay_match_eager(engine: Engine) -> None:
    model = MLPWithBreak()
    counter = CallCounter(model.run)
    x_buf = torch.randn(max(SIZES), DIM, device=cuda())
    contexts: list[ForwardContext | None] = []

    def recording(x: torch.Tensor) -> torch.Tensor:
        contexts.append(get_forward_context())
        return counter(x)

    wrapper = _engine(engine, CallCounter(recording))
    for n in SIZES:  # largest first
        key = BatchDescriptor(n)
        assert not wrapper.is_captured(key)
        data = fill_fresh_(x_buf[:n])
        out = wrapper.capture(key, x_buf[:n]).clone()
        assert wrapper.is_captured(key)
        assert rel_err(out, model.run(data)) < FP32_TOL  # the capture's outputs are this call's
    # The warm-up runs under NONE, the capture under the engine's mode, both naming the key.
    modes = {c.runtime_mode for c in contexts if c is not None}
    assert modes == {CUDAGraphMode.NONE, CAPTURE_MODE[engine]}
    assert None not in contexts
    assert get_forward_context() is None  # restored after each capture
    python_calls = counter.calls
    for _ in range(3):
        for n in (SIZES[2], SIZES[0], SIZES[3], SIZES[1]):
            data = fill_fresh_(x_buf[:n])
            got = wrapper.replay(BatchDescriptor(n))
            assert got.shape == (n, DIM)
            err = rel_err(got, model.run(data))
            assert err < FP32_TOL, f"replay of {n} tokens differs from eager: {err:.3e}"
    assert counter.calls == python_calls  # a replay runs no Python of the body (breaks run directly)


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("engine", ENGINES)
def test_replay_goes_through_the_public_graph_replay(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replay calls ``torch.cuda.CUDAGraph.replay`` (liveness checks, hooks), not ``torch._C``."""
    calls: list[torch.cuda.CUDAGraph] = []
    public = torch.cuda.CUDAGraph.replay

    def counting(graph: torch.cuda.CUDAGraph) -> None:
        calls.append(graph)
        public(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    model = MLPWithBreak()
    wrapper = _engine(engine, CallCounter(model.run))
    x = torch.randn(8, DIM, device=cuda())
    wrapper.capture(BatchDescriptor(8), x)
    calls.clear()
    fill_fresh_(x)
    got = wrapper.replay(BatchDescriptor(8))
    assert len(calls) >= 1  # one graph, or one per segment of the breakable engine
    assert rel_err(got, model.run(x)) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("engine", ENGINES)
def test_the_engine_alone_owns_what_is_captured(engine: Engine) -> None:
    """Capturing twice is refused, ``discard`` frees one key, ``clear`` all; replays of others go on."""
    model = MLPWithBreak()
    wrapper = _engine(engine, CallCounter(model.run))
    x_buf = torch.randn(max(SIZES), DIM, device=cuda())
    for n in SIZES:
        wrapper.capture(BatchDescriptor(n), x_buf[:n])
    with pytest.raises(ValueError, match=r"descriptor: .*num_tokens=8.* is already captured"):
        wrapper.capture(BatchDescriptor(8), x_buf[:8])
    wrapper.discard(BatchDescriptor(8))
    assert not wrapper.is_captured(BatchDescriptor(8))
    with pytest.raises(KeyError, match=r"no graph captured for .*num_tokens=8"):
        wrapper.replay(BatchDescriptor(8))
    data = fill_fresh_(x_buf[:3])
    assert rel_err(wrapper.replay(BatchDescriptor(3)), model.run(data)) < FP32_TOL
    wrapper.capture(BatchDescriptor(8), x_buf[:8])  # captured again after the discard
    data = fill_fresh_(x_buf[:8])
    assert rel_err(wrapper.replay(BatchDescriptor(8)), model.run(data)) < FP32_TOL
    wrapper.clear()
    assert not any(wrapper.is_captured(BatchDescriptor(n)) for n in SIZES)


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_explicit_capture_names_the_key_and_leaves_the_engine_usable(engine: Engine) -> None:
    model = MLPWithBreak()
    fail = {"now": False}

    def flaky(x: torch.Tensor) -> torch.Tensor:
        if fail["now"] and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("boom")
        return model.run(x)

    wrapper = _engine(engine, CallCounter(flaky))
    x_buf = torch.randn(max(SIZES), DIM, device=cuda())
    fail["now"] = True
    with pytest.raises(CaptureError, match=r"boom.*descriptor: .*num_tokens=24"):
        wrapper.capture(BatchDescriptor(24), x_buf)
    assert not wrapper.is_captured(BatchDescriptor(24))
    assert get_forward_context() is None
    fail["now"] = False
    wrapper.capture(BatchDescriptor(24), x_buf)
    data = fill_fresh_(x_buf)
    assert rel_err(wrapper.replay(BatchDescriptor(24)), model.run(data)) < FP32_TOL


@pytest.mark.parametrize("engine", ENGINES)
def test_replay_of_a_key_never_captured_says_so(engine: Engine) -> None:
    wrapper = _engine(engine, CallCounter(lambda x: x))
    with pytest.raises(KeyError, match=r"no graph captured for"):
        wrapper.replay(BatchDescriptor(1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no CUDA device")
@pytest.mark.parametrize("engine", ENGINES)
def test_capture_without_cuda_raises_a_capture_error(engine: Engine) -> None:
    """Never torch's "Torch not compiled with CUDA enabled" assert: a CaptureError naming the key."""
    wrapper = _engine(engine, CallCounter(lambda x: x * 2.0))
    with pytest.raises(CaptureError, match=r"needs a CUDA device, and none is available.*num_tokens=4"):
        wrapper.capture(BatchDescriptor(4), torch.ones(4))
    assert not wrapper.is_captured(BatchDescriptor(4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no CUDA device")
def test_the_shared_pool_without_cuda_says_a_device_is_needed() -> None:
    """Not torch's "Torch not compiled with CUDA enabled" assert."""
    with pytest.raises(RuntimeError, match="needs a CUDA device, and none is available here"):
        shared_pool()
    with pytest.raises(RuntimeError, match="needs a CUDA device, and none is available here"):
        capture_stream()
