"""The wrapper contract, for both engines: capture once per descriptor, replay after.

Every numeric check copies fresh ``randn`` data into the static input buffer,
replays, and compares with eager on the same data, so a stale or skipped
replay cannot pass. The cases follow vLLM's CUDAGraphWrapper tests.
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Callable
from typing import Literal, cast

import pytest
import torch
from torch.nn.functional import linear

from cudagraph_capture import (
    BreakableCUDAGraphCapture,
    CaptureDisabledError,
    CaptureError,
    CaptureOptions,
    CUDAGraphWrapper,
    capture_enabled,
    set_capture_enabled,
)
from cudagraph_capture._weakref import weak_ref_tensors
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from tests.capture.helpers import (
    CAPTURING_CASES,
    DIM,
    ENGINE_CASES,
    FP32_TOL,
    HIDDEN,
    SIZES,
    CallCounter,
    Engine,
    MLPWithBreak,
    TinyMLP,
    as_tensor,
    call,
    case_id,
    cuda,
    fill_fresh_,
    make_wrapper,
    new_stream,
    rel_err,
    sleep_gpu,
    warm_up,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_capture_state")]

Case = tuple[Engine, CUDAGraphMode]


def _input_buffer() -> torch.Tensor:
    # Static input for every size: size n reads rows [:n] (one address for all).
    return torch.randn(max(SIZES), DIM, device=cuda())


def _capture_all(wrapper: Callable[[torch.Tensor], object], x_buf: torch.Tensor, mode: CUDAGraphMode) -> None:
    for n in SIZES:  # largest first, as an engine captures
        call(wrapper, x_buf[:n], mode, BatchDescriptor(n))


def _assert_replay_matches(
    wrapper: Callable[[torch.Tensor], object],
    eager: Callable[[torch.Tensor], torch.Tensor],
    x_buf: torch.Tensor,
    n: int,
    mode: CUDAGraphMode,
) -> None:
    data = fill_fresh_(x_buf[:n])
    expected = eager(data)
    got = call(wrapper, x_buf[:n], mode, BatchDescriptor(n)).clone()
    err = rel_err(got, expected)
    assert err < FP32_TOL, f"replay of num_tokens={n} differs from eager: rel err {err:.3e}"


# ---------------------------------------------------------------------------
# Capture and replay
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CAPTURING_CASES, ids=case_id)
def test_replay_matches_eager_on_fresh_inputs(case: Case) -> None:
    """Each captured size replays to eager's result on new data, in any order, round after round."""
    engine, mode = case
    model = MLPWithBreak()
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, model.run, mode)
    warm_up(model.run, x_buf, SIZES)
    _capture_all(wrapper, x_buf, mode)
    assert wrapper.num_captured == len(SIZES)
    for _ in range(3):
        for n in (SIZES[2], SIZES[0], SIZES[3], SIZES[1]):  # not the capture order
            _assert_replay_matches(wrapper, model.run, x_buf, n, mode)


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_replays_return_the_captured_output_tensors(case: Case) -> None:
    """Replays return the output captured for the descriptor (same address), never a new allocation."""
    engine, mode = case
    model = TinyMLP()
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, model.run, mode)
    sizes = SIZES[:2]
    warm_up(model.run, x_buf, sizes)
    captured = {n: call(wrapper, x_buf[:n], mode, BatchDescriptor(n)).data_ptr() for n in sizes}
    for _ in range(3):
        for n in sizes:
            fill_fresh_(x_buf[:n])
            out = call(wrapper, x_buf[:n], mode, BatchDescriptor(n))
            assert out.shape == (n, DIM)
            assert out.data_ptr() == captured[n]


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_replay_runs_no_python_of_the_body(case: Case) -> None:
    """The runnable's Python runs once per descriptor, under capture, and never on replay."""
    engine, mode = case
    model = TinyMLP()
    counter = CallCounter(model.run)
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, counter, mode)
    sizes = SIZES[:2]
    warm_up(counter, x_buf, sizes)
    assert (counter.calls, counter.captures) == (2, 0)
    for n in sizes:
        call(wrapper, x_buf[:n], mode, BatchDescriptor(n))
    assert counter.captures == 2  # once per descriptor (eager warm-ups aside)
    after_capture = counter.calls
    for _ in range(5):
        for n in sizes:
            _assert_replay_matches(wrapper, model.run, x_buf, n, mode)
    assert counter.calls == after_capture


PassThrough = tuple[Engine, CUDAGraphMode, CUDAGraphMode | None]
PASS_THROUGH_CASES: tuple[PassThrough, ...] = (
    # (engine, mode the wrapper captures, forward-context mode; None = no context)
    ("monolithic", CUDAGraphMode.FULL, None),
    ("monolithic", CUDAGraphMode.FULL, CUDAGraphMode.NONE),
    ("monolithic", CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
    ("monolithic", CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL),
    ("breakable", CUDAGraphMode.PIECEWISE, None),
    ("breakable", CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE),
)


def _pass_through_id(case: PassThrough) -> str:
    context = "no-context" if case[2] is None else case[2].name
    return f"{case[0]}-{case[1].name}-under-{context}"


@pytest.mark.parametrize("case", PASS_THROUGH_CASES, ids=_pass_through_id)
def test_pass_through_calls_the_runnable(case: PassThrough) -> None:
    """No context, NONE, or another mode's context: the runnable runs eagerly each call; no capture."""
    engine, wrapper_mode, context_mode = case
    model = TinyMLP()
    counter = CallCounter(model.run)
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, counter, wrapper_mode)
    n = SIZES[1]
    for i in range(3):
        data = fill_fresh_(x_buf[:n])
        got = call(wrapper, x_buf[:n], context_mode, BatchDescriptor(n))
        assert rel_err(got, model.run(data)) < FP32_TOL
        assert counter.calls == i + 1
    assert counter.capturing == [False, False, False]
    assert wrapper.num_captured == 0


# ---------------------------------------------------------------------------
# Nested wrappers: a FULL wrapper around a model whose inner part is PIECEWISE
# ---------------------------------------------------------------------------


class _OuterModel:
    """``tanh(W inner(x))``: an eager tail around an inner (possibly wrapped) block."""

    def __init__(self, inner: Callable[[torch.Tensor], object]) -> None:
        self.inner = inner
        self.weight = torch.randn(DIM, DIM, device=cuda()) / math.sqrt(DIM)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = as_tensor(self.inner(x))
        return torch.tanh(linear(h, self.weight))


def test_nested_wrappers_capture_only_the_matching_mode() -> None:
    """Under FULL only the outer wrapper captures (the inner runs in its graph); under PIECEWISE the inner."""
    n = 8
    full = BatchDescriptor(n, num_reqs=n)
    piecewise = BatchDescriptor(n)
    inner_model = TinyMLP()
    inner_counter = CallCounter(inner_model.run)
    inner = CUDAGraphWrapper(inner_counter, CUDAGraphMode.PIECEWISE)
    outer_model = _OuterModel(inner)
    outer_counter = CallCounter(outer_model)
    outer = CUDAGraphWrapper(outer_counter, CUDAGraphMode.FULL)
    eager = _OuterModel(inner_model.run)  # the same computation, no wrappers
    eager.weight = outer_model.weight
    x_buf = _input_buffer()

    call(outer, x_buf[:n], CUDAGraphMode.NONE, piecewise)  # warm-up: both pass through
    assert (outer_counter.calls, inner_counter.calls) == (1, 1)

    # FULL: the outer captures; the inner runs inside that capture without capturing itself.
    call(outer, x_buf[:n], CUDAGraphMode.FULL, full)
    assert (outer.num_captured, inner.num_captured) == (1, 0)
    assert (outer_counter.captures, inner_counter.captures) == (1, 1)
    calls = (outer_counter.calls, inner_counter.calls)
    for _ in range(3):
        data = fill_fresh_(x_buf[:n])
        got = call(outer, x_buf[:n], CUDAGraphMode.FULL, full).clone()
        assert rel_err(got, eager(data)) < FP32_TOL
    assert (outer_counter.calls, inner_counter.calls) == calls  # replays run no Python

    # PIECEWISE: the outer passes through (its tail runs eagerly); the inner captures.
    call(outer, x_buf[:n], CUDAGraphMode.PIECEWISE, piecewise)
    assert (outer.num_captured, inner.num_captured) == (1, 1)
    assert (outer_counter.captures, inner_counter.captures) == (1, 2)
    calls = (outer_counter.calls, inner_counter.calls)
    for _ in range(3):
        data = fill_fresh_(x_buf[:n])
        got = call(outer, x_buf[:n], CUDAGraphMode.PIECEWISE, piecewise).clone()
        assert rel_err(got, eager(data)) < FP32_TOL
    # The outer body runs eagerly each call; the inner one is replayed.
    assert (outer_counter.calls, inner_counter.calls) == (calls[0] + 3, calls[1])

    # The FULL graph still replays correctly next to the inner graph in the shared pool.
    calls = (outer_counter.calls, inner_counter.calls)
    data = fill_fresh_(x_buf[:n])
    got = call(outer, x_buf[:n], CUDAGraphMode.FULL, full).clone()
    assert rel_err(got, eager(data)) < FP32_TOL
    assert (outer_counter.calls, inner_counter.calls) == calls
    assert (outer_counter.captures, inner_counter.captures) == (1, 2)


# ---------------------------------------------------------------------------
# The wrapper object: unwrap, attributes, num_captured, clear, runtime_mode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
@pytest.mark.parametrize(("name", "value"), [("marker", "tiny-mlp"), ("hidden", HIDDEN)])
def test_attributes_fall_through_to_the_runnable(case: Case, name: str, value: object) -> None:
    """``unwrap()`` gives the runnable; other attributes are read from it; missing ones: AttributeError."""
    engine, mode = case
    model = TinyMLP()
    wrapper = make_wrapper(engine, model, mode)
    assert wrapper.unwrap() is model
    assert getattr(wrapper, name) == value
    missing = "no_such_attribute"
    with pytest.raises(AttributeError):
        getattr(wrapper, missing)


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE])
def test_runtime_mode_is_kept(mode: CUDAGraphMode) -> None:
    """The monolithic wrapper reports the mode it was built for."""
    wrapper = CUDAGraphWrapper(TinyMLP().run, mode)
    assert wrapper.runtime_mode is mode


@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE]
)
def test_invalid_runtime_mode_is_rejected(mode: CUDAGraphMode) -> None:
    """Only FULL and PIECEWISE are runtime modes a wrapper can capture; the error names the mode."""
    # Called through a loose signature: the point is the runtime check, whatever the annotation.
    make = cast("Callable[..., object]", CUDAGraphWrapper)
    with pytest.raises(ValueError, match=mode.name):
        make(TinyMLP().run, mode)


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_num_captured_and_clear(case: Case) -> None:
    """``num_captured`` counts descriptors; ``clear()`` drops every graph; the next call captures afresh."""
    engine, mode = case
    model = TinyMLP()
    counter = CallCounter(model.run)
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, counter, mode)
    warm_up(model.run, x_buf, SIZES[:2])
    assert wrapper.num_captured == 0
    call(wrapper, x_buf[: SIZES[0]], mode, BatchDescriptor(SIZES[0]))
    assert wrapper.num_captured == 1
    call(wrapper, x_buf[: SIZES[1]], mode, BatchDescriptor(SIZES[1]))
    call(wrapper, x_buf[: SIZES[1]], mode, BatchDescriptor(SIZES[1]))  # a replay adds nothing
    assert wrapper.num_captured == 2
    assert counter.captures == 2

    wrapper.clear()
    gc.collect()
    assert wrapper.num_captured == 0
    call(wrapper, x_buf[: SIZES[1]], mode, BatchDescriptor(SIZES[1]))
    assert counter.captures == 3
    assert wrapper.num_captured == 1
    after_capture = counter.calls
    for _ in range(2):
        _assert_replay_matches(wrapper, model.run, x_buf, SIZES[1], mode)
    assert counter.calls == after_capture


# ---------------------------------------------------------------------------
# Capture disabled, failed captures
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_capture_disabled_raises_and_the_wrapper_recovers(case: Case) -> None:
    """With capture off, a new descriptor raises CaptureDisabledError; replays and pass-through still work."""
    engine, mode = case
    model = MLPWithBreak()
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, model.run, mode)
    big, small = SIZES[0], SIZES[1]
    warm_up(model.run, x_buf, (big, small))
    call(wrapper, x_buf[:big], mode, BatchDescriptor(big))

    assert issubclass(CaptureDisabledError, CaptureError)
    set_capture_enabled(False)
    try:
        assert capture_enabled() is False
        with pytest.raises(CaptureDisabledError) as info:
            call(wrapper, x_buf[:small], mode, BatchDescriptor(small))
        assert info.value.descriptor == BatchDescriptor(small)
        assert f"num_tokens={small}" in str(info.value)
        assert wrapper.num_captured == 1
        assert not torch.cuda.is_current_stream_capturing()
        # Replaying an existing graph is not a capture.
        _assert_replay_matches(wrapper, model.run, x_buf, big, mode)
        # Neither is an eager pass-through.
        data = fill_fresh_(x_buf[:small])
        got = call(wrapper, x_buf[:small], CUDAGraphMode.NONE, BatchDescriptor(small))
        assert rel_err(got, model.run(data)) < FP32_TOL
    finally:
        set_capture_enabled(True)
    assert capture_enabled() is True
    call(wrapper, x_buf[:small], mode, BatchDescriptor(small))
    assert wrapper.num_captured == 2
    _assert_replay_matches(wrapper, model.run, x_buf, small, mode)
    _assert_replay_matches(wrapper, model.run, x_buf, big, mode)


Failure = Literal["python-error", "host-sync"]


class _FlakyModel:
    """Runs a model; while ``failure`` is set, fails under capture, after the model's kernels were launched.

    Eager calls (warm-ups) succeed, so the failure is the capture's alone.
    """

    def __init__(self, model: MLPWithBreak) -> None:
        self.model = model
        self.failure: Failure | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.model.run(x)
        if self.failure == "python-error" and torch.cuda.is_current_stream_capturing():
            raise ValueError("boom: the runnable failed under capture")
        if self.failure == "host-sync" and math.isnan(y.sum().item()):  # .item() syncs: illegal under capture
            raise AssertionError("unreachable: the sum of finite values is finite")
        return y


@pytest.mark.parametrize("failure", ["python-error", "host-sync"])
@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_failed_capture_names_the_descriptor_and_leaves_the_wrapper_usable(
    case: Case, failure: Failure
) -> None:
    """A failing capture raises CaptureError naming the descriptor, drops the entry, leaves nothing open."""
    engine, mode = case
    flaky = _FlakyModel(MLPWithBreak())
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, flaky, mode)
    big, small = SIZES[0], SIZES[1]
    warm_up(flaky, x_buf, (big, small))
    call(wrapper, x_buf[:big], mode, BatchDescriptor(big))

    flaky.failure = failure
    with pytest.raises(CaptureError) as info:
        call(wrapper, x_buf[:small], mode, BatchDescriptor(small))
    assert not isinstance(info.value, CaptureDisabledError)
    assert info.value.descriptor == BatchDescriptor(small)
    assert f"num_tokens={small}" in str(info.value)
    # The capture was ended and undone: no entry, no capture left open, the caller's stream restored.
    assert wrapper.num_captured == 1
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert BreakableCUDAGraphCapture.current() is None
    # Other graphs are untouched.
    _assert_replay_matches(wrapper, flaky.model.run, x_buf, big, mode)
    # The same descriptor captures fine once the runnable behaves.
    flaky.failure = None
    call(wrapper, x_buf[:small], mode, BatchDescriptor(small))
    assert wrapper.num_captured == 2
    for _ in range(2):
        _assert_replay_matches(wrapper, flaky.model.run, x_buf, small, mode)
        _assert_replay_matches(wrapper, flaky.model.run, x_buf, big, mode)


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_check_input_addresses(case: Case) -> None:
    """With check_input_addresses, an input at another address raises on replay; the captured one replays."""
    engine, mode = case
    model = TinyMLP()
    x_buf = _input_buffer()
    n = SIZES[1]
    warm_up(model.run, x_buf, (n,))
    checked = make_wrapper(engine, model.run, mode, CaptureOptions(check_input_addresses=True))
    call(checked, x_buf[:n], mode, BatchDescriptor(n))
    _assert_replay_matches(checked, model.run, x_buf, n, mode)

    moved = torch.randn(n, DIM, device=cuda())
    assert moved.data_ptr() != x_buf.data_ptr()
    # The error names the argument by its path (the input is passed positionally) and both addresses.
    moved_at = re.escape(f"{moved.data_ptr():#x}")
    captured_at = re.escape(f"{x_buf.data_ptr():#x}")
    with pytest.raises(
        ValueError,
        match=rf"^args\[0\]: tensor at address {moved_at}\b.*captured reading args\[0\] at {captured_at}\b",
    ):
        call(checked, moved, mode, BatchDescriptor(n))
    _assert_replay_matches(checked, model.run, x_buf, n, mode)  # still usable

    # Without the check (the default) the same call replays the graph on its captured input.
    unchecked = make_wrapper(engine, model.run, mode)
    call(unchecked, x_buf[:n], mode, BatchDescriptor(n))
    data = fill_fresh_(x_buf[:n])
    got = call(unchecked, moved, mode, BatchDescriptor(n))
    assert rel_err(got, model.run(data)) < FP32_TOL


OPTION_CASES: tuple[CaptureOptions, ...] = (
    CaptureOptions(),
    CaptureOptions(gc_disable=False),
    CaptureOptions(weak_ref_output=False),
    CaptureOptions(gc_disable=False, weak_ref_output=False),
)


def _options_id(options: CaptureOptions) -> str:
    return f"gc_disable={options.gc_disable}-weak_ref_output={options.weak_ref_output}"


@pytest.mark.parametrize("options", OPTION_CASES, ids=_options_id)
@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_options_keep_replays_correct(case: Case, options: CaptureOptions) -> None:
    """gc_disable and weak_ref_output, on or off, change memory and speed, never results."""
    engine, mode = case
    model = MLPWithBreak()
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, model.run, mode, options)
    warm_up(model.run, x_buf, SIZES)
    _capture_all(wrapper, x_buf, mode)
    for _ in range(2):
        for n in SIZES:
            _assert_replay_matches(wrapper, model.run, x_buf, n, mode)


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_gc_disable_skips_gc_and_empty_cache_per_capture(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """With gc_disable (the default), capturing sizes runs no gc.collect or empty_cache per capture."""
    engine, mode = case
    counts = {"gc.collect": 0, "torch.cuda.empty_cache": 0}

    def counting_collect(generation: int = 2) -> int:
        counts["gc.collect"] += 1
        return 0

    def counting_empty_cache() -> None:
        counts["torch.cuda.empty_cache"] += 1

    model = TinyMLP()
    x_buf = _input_buffer()
    wrapper = make_wrapper(engine, model.run, mode)
    warm_up(model.run, x_buf, SIZES)
    monkeypatch.setattr(gc, "collect", counting_collect)
    monkeypatch.setattr(torch.cuda, "empty_cache", counting_empty_cache)
    _capture_all(wrapper, x_buf, mode)
    monkeypatch.undo()
    assert wrapper.num_captured == len(SIZES)
    # At most one clean-up in all (e.g. before the first capture), never one per capture.
    assert counts["gc.collect"] <= 1, counts
    assert counts["torch.cuda.empty_cache"] <= 1, counts
    _assert_replay_matches(wrapper, model.run, x_buf, SIZES[-1], mode)


# ---------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream_kind", ["default-stream", "side-stream"])
@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_capture_and_replay_follow_the_callers_stream(case: Case, stream_kind: str) -> None:
    """Capture works from the caller's stream (the default one too); replay is ordered on that stream."""
    engine, mode = case
    model = MLPWithBreak()
    x_buf = _input_buffer()
    n = SIZES[1]
    wrapper = make_wrapper(engine, model.run, mode)
    stream = torch.cuda.default_stream() if stream_kind == "default-stream" else new_stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        assert torch.cuda.current_stream() == stream
        on_default = torch.cuda.current_stream() == torch.cuda.default_stream()
        assert on_default == (stream_kind == "default-stream")
        warm_up(model.run, x_buf, (n,))
        call(wrapper, x_buf[:n], mode, BatchDescriptor(n))
        assert wrapper.num_captured == 1
        assert torch.cuda.current_stream() == stream  # the capture gave the caller its stream back
        for _ in range(2):
            data = torch.randn(n, DIM, device=cuda())
            expected = model.run(data)
            # The stream is busy for tens of ms, so the copy below lands late: a replay not
            # ordered after it reads the old input; a clone not ordered after the replay reads
            # the old output.
            sleep_gpu()
            x_buf[:n].copy_(data)
            got = call(wrapper, x_buf[:n], mode, BatchDescriptor(n)).clone()
            torch.cuda.synchronize()
            assert rel_err(got, expected) < FP32_TOL


# ---------------------------------------------------------------------------
# weak_ref_tensors
# ---------------------------------------------------------------------------


def test_weak_ref_tensors_aliases_cuda_tensors_without_owning_them() -> None:
    """CUDA tensors in a pytree become aliases of the same memory that do not keep it allocated."""
    numel = 4 * 2**20  # 16 MiB of fp32
    big = torch.randn(numel, device=cuda())
    view = big[8:40].view(4, 8)
    cpu = torch.randn(3)
    tree = {"big": big, "pair": (view, 7), "more": [cpu, "text", None]}
    aliased = weak_ref_tensors(tree)

    assert isinstance(aliased, dict)
    assert set(aliased) == {"big", "pair", "more"}
    alias = as_tensor(aliased["big"])
    assert alias is not big
    assert (alias.data_ptr(), alias.shape, alias.stride(), alias.dtype) == (
        big.data_ptr(),
        big.shape,
        big.stride(),
        big.dtype,
    )
    assert torch.equal(alias, big)
    pair = aliased["pair"]
    assert isinstance(pair, tuple)
    assert len(pair) == 2
    view_alias = as_tensor(pair[0])
    assert (view_alias.data_ptr(), view_alias.shape, view_alias.stride()) == (
        view.data_ptr(),
        view.shape,
        view.stride(),
    )
    assert torch.equal(view_alias, view)
    assert pair[1] == 7
    more = aliased["more"]
    assert isinstance(more, list)
    assert more[1:] == ["text", None]
    cpu_leaf = as_tensor(more[0])
    assert cpu_leaf.device.type == "cpu"
    assert torch.equal(cpu_leaf, cpu)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    del big, view, tree
    gc.collect()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= numel * 4, f"the aliases kept the memory alive: only {freed} bytes freed"
    del alias, view_alias, aliased, pair  # dangling now: never read
