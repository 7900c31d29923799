"""The breakable engine: graph segments split by eager breaks.

Follows vLLM's tests/v1/cudagraph/test_breakable_cudagraph.py: segment
counts, replay order and numerics, nested decorated ops, clean-up after an
exception, per-thread state, the rules for eager functions (no CUDA tensor
returned, side streams joined), breaks inside a monolithic capture, and
eager arguments that do not pin memory. Every segment launches at least one
kernel: torch warns on an empty graph, and warnings are errors here.
"""

from __future__ import annotations

import gc
import re
import threading
import weakref
from collections.abc import Callable
from typing import Literal

import pytest
import torch
from torch import nn

from cudagraph_capture import (
    BreakableCUDAGraphCapture,
    BreakableCUDAGraphWrapper,
    CaptureDisabledError,
    CaptureError,
    CUDAGraphWrapper,
    eager_break_during_capture,
    set_capture_enabled,
)
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from tests.capture.helpers import (
    DIM,
    FP32_TOL,
    CallCounter,
    CountingSiLU,
    MLPWithBreak,
    as_tensor,
    call,
    cuda,
    fill_fresh_,
    new_stream,
    rel_err,
    sleep_gpu,
    warm_up,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_capture_state")]

N: int = 16  # elements of the small static buffers


def _static(numel: int = N) -> torch.Tensor:
    return torch.randn(numel, device=cuda())


def _assert_no_capture_left() -> None:
    assert BreakableCUDAGraphCapture.current() is None
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _assert_capture_works() -> None:
    """A fresh capture with one break replays correctly (nothing was left broken)."""
    x, out = _static(), _static()
    cap = BreakableCUDAGraphCapture()
    with cap:
        h = x * 2.0
        cap.add_eager(_add_into, h, 1.0, out)
        out.mul_(3.0)
    assert (cap.num_graphs, cap.num_eager_breaks) == (2, 1)
    data = fill_fresh_(x)
    cap.replay()
    assert rel_err(out, (data * 2.0 + 1.0) * 3.0) < FP32_TOL


@eager_break_during_capture
def _double_(t: torch.Tensor) -> None:
    t.mul_(2.0)


def _plain_double_(t: torch.Tensor) -> None:
    t.mul_(2.0)


def _add_into(src: torch.Tensor, value: float, out: torch.Tensor) -> None:
    torch.add(src, value, out=out)


# ---------------------------------------------------------------------------
# Thread-local state and nesting
# ---------------------------------------------------------------------------


def test_current_is_none_outside_a_capture() -> None:
    """No capture is active unless one was entered."""
    assert BreakableCUDAGraphCapture.current() is None


def test_current_is_the_active_capture_and_cleared_on_exit() -> None:
    """Inside the body current() is the capture and its stream is capturing; after exit, neither."""
    x = _static()
    cap = BreakableCUDAGraphCapture()
    with cap:
        assert BreakableCUDAGraphCapture.current() is cap
        assert torch.cuda.is_current_stream_capturing()
        x.add_(1.0)
    _assert_no_capture_left()


def test_nested_capture_raises_and_the_outer_one_survives() -> None:
    """Entering a capture while one is active in the thread raises RuntimeError; the outer capture goes on."""
    x = _static()
    outer = BreakableCUDAGraphCapture()
    with outer:
        x.add_(1.0)
        with pytest.raises(RuntimeError), BreakableCUDAGraphCapture():
            x.add_(100.0)
        assert BreakableCUDAGraphCapture.current() is outer
        x.add_(1.0)
    _assert_no_capture_left()
    data = fill_fresh_(x)
    outer.replay()
    assert rel_err(x, data + 2.0) < FP32_TOL


def test_capture_state_is_per_thread() -> None:
    """Another thread sees no active capture, and a decorated function runs plainly there (no break)."""

    @eager_break_during_capture
    def host_only(value: int) -> int:
        return value * 2

    seen: dict[str, object] = {}

    def worker() -> None:
        try:
            seen["current"] = BreakableCUDAGraphCapture.current()
            seen["result"] = host_only(21)
        except BaseException as exc:  # reported by the main thread's assertion
            seen["error"] = exc

    x = _static()
    cap = BreakableCUDAGraphCapture()
    with cap:
        x.add_(1.0)
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert BreakableCUDAGraphCapture.current() is cap
        x.add_(1.0)
    assert seen == {"current": None, "result": 42}
    assert (cap.num_graphs, cap.num_eager_breaks) == (1, 0)
    data = fill_fresh_(x)
    cap.replay()
    assert rel_err(x, data + 2.0) < FP32_TOL


# ---------------------------------------------------------------------------
# Segments
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_breaks", [0, 1, 3])
@pytest.mark.parametrize("via", ["decorator", "add_eager"])
def test_n_breaks_make_n_plus_one_graphs(num_breaks: int, via: Literal["decorator", "add_eager"]) -> None:
    """N eager breaks give N + 1 graphs; replay interleaves them in order on fresh data."""
    x = _static()
    cap = BreakableCUDAGraphCapture()
    with cap:
        for i in range(num_breaks + 1):
            x.add_(1.0)  # graph segment i
            if i < num_breaks:
                if via == "decorator":
                    _double_(x)
                else:
                    cap.add_eager(_plain_double_, x)
    assert cap.num_graphs == num_breaks + 1
    assert cap.num_eager_breaks == num_breaks
    for _ in range(2):
        data = fill_fresh_(x)
        expected = data.clone()
        for i in range(num_breaks + 1):
            expected += 1.0
            if i < num_breaks:
                expected *= 2.0
        cap.replay()
        assert rel_err(x, expected) < FP32_TOL


def test_eager_segments_run_once_at_capture_then_once_per_replay_in_order() -> None:
    """Eager functions run once while capturing and once per replay, in capture order."""
    x = _static()
    log: list[str] = []

    def step(name: str) -> Callable[[], None]:
        def run() -> None:
            log.append(name)
            x.add_(1.0)

        return run

    cap = BreakableCUDAGraphCapture()
    with cap:
        x.mul_(2.0)
        cap.add_eager(step("A"))
        x.mul_(2.0)
        cap.add_eager(step("B"))
        x.mul_(2.0)
        cap.add_eager(step("C"))
        x.mul_(2.0)
    assert log == ["A", "B", "C"]
    data = fill_fresh_(x)
    cap.replay()
    assert log == ["A", "B", "C"] * 2
    assert rel_err(x, (((data * 2 + 1) * 2 + 1) * 2 + 1) * 2) < FP32_TOL


def test_add_eager_returns_the_result_and_passes_arguments() -> None:
    """add_eager(fn, *args, **kwargs) calls fn with them and returns its (non-CUDA) result."""
    x = _static()

    def combine(a: int, b: int, *, scale: int) -> int:
        return (a + b) * scale

    cap = BreakableCUDAGraphCapture()
    with cap:
        x.add_(1.0)
        assert cap.add_eager(combine, 2, 3, scale=4) == 20
        x.add_(1.0)
    assert cap.num_eager_breaks == 1


def test_eager_fn_runs_on_the_capture_stream_then_on_the_replaying_stream() -> None:
    """At capture an eager function runs on the capture stream; at replay, on the caller's current stream."""
    x = _static()
    streams: list[torch.cuda.Stream] = []

    def record() -> None:
        streams.append(torch.cuda.current_stream())
        x.add_(1.0)

    cap = BreakableCUDAGraphCapture()
    with cap:
        capture_stream = torch.cuda.current_stream()
        x.add_(1.0)
        cap.add_eager(record)
        x.add_(1.0)
    assert streams == [capture_stream]
    side = new_stream()
    with torch.cuda.stream(side):
        cap.replay()
    torch.cuda.synchronize()
    assert streams == [capture_stream, side]


class _Stack(nn.Module):
    """Three MLP blocks with one eager break each: four graph segments."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLPWithBreak() for _ in range(3)])
        self.typed_blocks = [block for block in self.blocks if isinstance(block, MLPWithBreak)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.typed_blocks:
            x = block.run(x)
        return x

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return as_tensor(self(x))

    def silu_calls(self) -> list[int]:
        return [block.silu.calls for block in self.typed_blocks]


def test_model_with_breaks_replays_like_eager() -> None:
    """A model with a break per block replays to eager's result on fresh inputs; breaks rerun per replay."""
    model = _Stack()
    x = torch.randn(8, DIM, device=cuda())
    warm_up(model.run, x, (8,))
    cap = BreakableCUDAGraphCapture()
    with cap:
        out = model.run(x)
    assert (cap.num_graphs, cap.num_eager_breaks) == (4, 3)
    assert model.silu_calls() == [2, 2, 2]
    for round_ in range(1, 4):
        data = fill_fresh_(x)
        expected = model.run(data)  # eager: one more call per block
        cap.replay()
        assert rel_err(out, expected) < FP32_TOL
        assert model.silu_calls() == [2 + 2 * round_] * 3


def test_explicit_pool_and_stream() -> None:
    """A capture into a given pool, on a given stream, works like the defaults."""
    side = new_stream()
    x, out = _static(), _static()
    cap = BreakableCUDAGraphCapture(torch.cuda.graph_pool_handle(), stream=side)
    with cap:
        assert torch.cuda.current_stream() == side
        h = x * 2.0
        cap.add_eager(_add_into, h, 1.0, out)
        out.mul_(3.0)
    _assert_no_capture_left()
    data = fill_fresh_(x)
    cap.replay()
    assert rel_err(out, (data * 2.0 + 1.0) * 3.0) < FP32_TOL


# ---------------------------------------------------------------------------
# The decorator
# ---------------------------------------------------------------------------


def test_decorator_is_a_plain_call_outside_capture() -> None:
    """Outside any capture a decorated function is called once, normally, and may return anything."""
    calls: list[int] = []

    @eager_break_during_capture
    def triple(value: int) -> int:
        calls.append(value)
        return value * 3

    assert triple(5) == 15
    assert calls == [5]


def test_decorated_fn_may_return_host_values_during_capture() -> None:
    """Scalars and CPU tensors returned by a break reach the caller unchanged."""
    cpu = torch.arange(3)

    @eager_break_during_capture
    def host_values(t: torch.Tensor) -> tuple[int, torch.Tensor]:
        t.add_(1.0)
        return 7, cpu

    x = _static()
    cap = BreakableCUDAGraphCapture()
    with cap:
        x.mul_(2.0)
        result = host_values(x)
        x.mul_(2.0)
    assert isinstance(result, tuple)
    assert result[0] == 7
    assert result[1] is cpu
    assert cap.num_eager_breaks == 1


def test_nested_decorated_ops_break_once() -> None:
    """A decorated function called from a decorated function's body runs inline: one break, not two."""
    x = _static()
    inner_calls: list[int] = []

    @eager_break_during_capture
    def inner(t: torch.Tensor) -> None:
        inner_calls.append(1)
        t.add_(1.0)

    @eager_break_during_capture
    def outer(t: torch.Tensor) -> None:
        inner(t)
        t.add_(10.0)

    cap = BreakableCUDAGraphCapture()
    with cap:
        x.add_(2.0)
        outer(x)
        x.mul_(3.0)
    assert (cap.num_graphs, cap.num_eager_breaks) == (2, 1)
    assert len(inner_calls) == 1
    data = fill_fresh_(x)
    cap.replay()
    assert len(inner_calls) == 2
    assert rel_err(x, (data + 2.0 + 1.0 + 10.0) * 3.0) < FP32_TOL


@pytest.mark.parametrize("shape", ["tensor", "tuple", "dict"])
def test_decorated_fn_returning_a_cuda_tensor_raises(shape: str) -> None:
    """A break returning a CUDA tensor (also nested) raises CaptureError; the capture is ended cleanly."""

    @eager_break_during_capture
    def returns_cuda(t: torch.Tensor) -> object:
        fresh = t * 2.0  # a new tensor: its address would change each replay
        if shape == "tensor":
            return fresh
        if shape == "tuple":
            return (1, fresh)
        return {"out": fresh}

    x = _static()

    def capture() -> None:
        with BreakableCUDAGraphCapture():
            x.add_(1.0)
            returns_cuda(x)

    with pytest.raises(CaptureError):
        capture()
    _assert_no_capture_left()
    _assert_capture_works()


def test_unjoined_side_stream_raises_naming_the_join() -> None:
    """Work forked to a side stream and not joined before a break raises CaptureError that says to join it."""
    x = _static()
    side = new_stream()

    @eager_break_during_capture
    def consume(t: torch.Tensor) -> None:
        t.add_(1.0)

    def capture() -> None:
        with BreakableCUDAGraphCapture():
            y = x * 2.0
            side.wait_stream(torch.cuda.current_stream())  # fork
            with torch.cuda.stream(side):
                y.add_(1.0)
            consume(y)  # no join before the break

    with pytest.raises(CaptureError) as info:
        capture()
    assert re.search(r"(?i)join", str(info.value)), str(info.value)
    _assert_no_capture_left()
    _assert_capture_works()


def test_joined_side_stream_is_fine() -> None:
    """Side-stream work joined back before a break is captured and replayed correctly."""
    x, out = _static(), _static()
    side = new_stream()

    @eager_break_during_capture
    def triple_into(src: torch.Tensor, dst: torch.Tensor) -> None:
        torch.mul(src, 3.0, out=dst)

    cap = BreakableCUDAGraphCapture()
    with cap:
        y = x * 2.0
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y.add_(1.0)
        torch.cuda.current_stream().wait_stream(side)  # join
        triple_into(y, out)
        out.add_(1.0)
    assert (cap.num_graphs, cap.num_eager_breaks) == (2, 1)
    for _ in range(2):
        data = fill_fresh_(x)
        cap.replay()
        assert rel_err(out, (data * 2.0 + 1.0) * 3.0 + 1.0) < FP32_TOL


def test_decorated_fn_inside_a_full_capture_runs_inline() -> None:
    """Inside a monolithic FULL capture a decorated op is captured inline: no break, no Python on replay."""
    silu = CountingSiLU()
    seen_current: list[BreakableCUDAGraphCapture | None] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        seen_current.append(BreakableCUDAGraphCapture.current())
        h = x * 2.0
        act = torch.empty_like(h)
        silu(h, act)
        return act + 1.0

    def eager(x: torch.Tensor) -> torch.Tensor:
        h = x * 2.0
        return h * torch.sigmoid(h) + 1.0

    x = torch.randn(8, DIM, device=cuda())
    wrapper = CUDAGraphWrapper(CallCounter(body), CUDAGraphMode.FULL)
    desc = BatchDescriptor(8)
    warm_up(body, x, (8,))
    call(wrapper, x, CUDAGraphMode.FULL, desc)
    assert silu.capturing.count(True) == 1  # the op ran once, inside the FULL capture
    assert seen_current
    assert all(current is None for current in seen_current)
    after_capture = silu.calls
    for _ in range(3):
        data = fill_fresh_(x)
        got = call(wrapper, x, CUDAGraphMode.FULL, desc).clone()
        assert rel_err(got, eager(data)) < FP32_TOL
    assert silu.calls == after_capture


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_eager_arguments_do_not_pin_memory(keyword: bool) -> None:
    """A break keeps non-owning aliases of its tensor arguments: deleting the only owner frees the memory."""

    @eager_break_during_capture
    def consume(src: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(src, 2.0, out=out)

    numel = 4 * 2**20  # 16 MiB of fp32: far above any allocator rounding
    x = _static(numel)
    out = _static(numel)
    cap = BreakableCUDAGraphCapture()
    with cap:
        tmp = x * 3.0  # allocated inside the first segment
        tmp_ref = weakref.ref(tmp)
        if keyword:
            consume(src=tmp, out=out)
        else:
            consume(tmp, out)
        out.add_(1.0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    del tmp
    gc.collect()
    assert tmp_ref() is None
    freed = before - torch.cuda.memory_allocated()
    assert freed >= numel * 4, f"the capture kept the break's argument alive: {freed} bytes freed"
    for _ in range(2):
        data = fill_fresh_(x)
        cap.replay()
        assert rel_err(out, data * 6.0 + 1.0) < FP32_TOL


# ---------------------------------------------------------------------------
# Exceptions, capture disabled
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["body", "eager-fn", "after-a-break"])
def test_exception_ends_the_capture_and_propagates(where: str) -> None:
    """An exception in the body (or in a break) propagates; current() is None after; a new capture works."""
    x = _static()

    def failing_eager() -> None:
        raise ValueError("boom")

    def capture() -> None:
        cap = BreakableCUDAGraphCapture()
        with cap:
            x.add_(1.0)
            if where == "eager-fn":
                cap.add_eager(failing_eager)
            if where == "after-a-break":
                _double_(x)
                x.add_(1.0)
            raise ValueError("boom")

    with pytest.raises((ValueError, CaptureError)) as info:
        capture()
    assert any(isinstance(e, ValueError) and "boom" in str(e) for e in _exception_chain(info.value))
    _assert_no_capture_left()
    _assert_capture_works()


def test_capture_disabled_refuses_a_breakable_capture() -> None:
    """With capture disabled, entering a breakable capture raises CaptureDisabledError; nothing stays open."""
    x = _static()

    def capture() -> None:
        with BreakableCUDAGraphCapture():
            x.add_(1.0)

    set_capture_enabled(False)
    try:
        with pytest.raises(CaptureDisabledError):
            capture()
        _assert_no_capture_left()
    finally:
        set_capture_enabled(True)
    _assert_capture_works()


# ---------------------------------------------------------------------------
# Streams: capture ordered after the caller's stream, replay on it
# ---------------------------------------------------------------------------


def test_capture_is_ordered_after_and_before_the_callers_stream() -> None:
    """A break at capture sees the caller's earlier writes, and the caller sees the break's writes after."""
    x, out, pad = _static(), _static(), _static()
    data = torch.randn(N, device=cuda())
    torch.cuda.synchronize()

    def double_into_out() -> None:
        sleep_gpu()  # on the capture stream: a caller not waiting for it reads a stale `out`
        torch.mul(x, 2.0, out=out)

    sleep_gpu()  # the caller's (default) stream is busy for tens of ms...
    x.copy_(data)  # ...so `x` receives the data late
    cap = BreakableCUDAGraphCapture()
    with cap:
        pad.add_(1.0)
        cap.add_eager(double_into_out)
        pad.add_(1.0)
    seen = out.clone()  # on the caller's stream, right after the capture
    torch.cuda.synchronize()
    assert rel_err(seen, data * 2.0) < FP32_TOL


def test_replay_runs_on_the_callers_stream() -> None:
    """Graph segments and breaks replay in order on the caller's current stream (a side stream here)."""
    x, out = _static(), _static()

    @eager_break_during_capture
    def add_one_into(src: torch.Tensor, dst: torch.Tensor) -> None:
        torch.add(src, 1.0, out=dst)

    cap = BreakableCUDAGraphCapture()
    with cap:
        h = x * 2.0
        add_one_into(h, out)
        out.mul_(3.0)
    side = new_stream()
    for _ in range(2):
        with torch.cuda.stream(side):
            data = torch.randn(N, device=cuda())
            sleep_gpu()  # a replay not ordered on this stream would run before the copy
            x.copy_(data)
            cap.replay()
            got = out.clone()
        torch.cuda.synchronize()
        assert rel_err(got, (data * 2.0 + 1.0) * 3.0) < FP32_TOL


# ---------------------------------------------------------------------------
# BreakableCUDAGraphWrapper
# ---------------------------------------------------------------------------


def test_breakable_wrapper_replays_breaks_but_not_the_body() -> None:
    """The wrapper captures once per descriptor; replays rerun only the breaks, never the body's Python."""
    model = _Stack()
    counter = CallCounter(model.run)
    wrapper = BreakableCUDAGraphWrapper(counter)
    x_buf = torch.randn(8, DIM, device=cuda())
    desc = BatchDescriptor(8)
    warm_up(model.run, x_buf, (8,))
    out = call(wrapper, x_buf, CUDAGraphMode.PIECEWISE, desc)
    assert wrapper.num_captured == 1
    assert counter.captures == 1
    # Each break ran outside graph capture, although the forward was being captured.
    assert not any(flag for block in model.typed_blocks for flag in block.silu.capturing)
    calls, silu_calls = counter.calls, model.silu_calls()
    for round_ in range(1, 4):
        data = fill_fresh_(x_buf)
        expected = model.run(data)  # one eager call per block...
        got = call(wrapper, x_buf, CUDAGraphMode.PIECEWISE, desc)  # ...and one replayed break per block
        assert got.data_ptr() == out.data_ptr()
        assert rel_err(got, expected) < FP32_TOL
        assert model.silu_calls() == [c + 2 * round_ for c in silu_calls]
    assert counter.calls == calls


def test_breakable_wrapper_captures_under_any_graph_mode() -> None:
    """FULL and PIECEWISE contexts both capture (one graph set per descriptor); NONE passes through."""
    model = MLPWithBreak()
    counter = CallCounter(model.run)
    wrapper = BreakableCUDAGraphWrapper(counter)
    x_buf = torch.randn(8, DIM, device=cuda())
    full, piecewise = BatchDescriptor(8, num_reqs=8, uniform=True), BatchDescriptor(3)
    warm_up(model.run, x_buf, (8, 3))
    call(wrapper, x_buf[:8], CUDAGraphMode.FULL, full)
    call(wrapper, x_buf[:3], CUDAGraphMode.PIECEWISE, piecewise)
    assert wrapper.num_captured == 2
    assert counter.captures == 2
    calls = counter.calls
    call(wrapper, x_buf[:3], CUDAGraphMode.NONE, piecewise)
    assert (counter.calls, counter.captures) == (calls + 1, 2)
    for _ in range(2):
        for n, mode, desc in ((8, CUDAGraphMode.FULL, full), (3, CUDAGraphMode.PIECEWISE, piecewise)):
            data = fill_fresh_(x_buf[:n])
            got = call(wrapper, x_buf[:n], mode, desc).clone()
            assert rel_err(got, model.run(data)) < FP32_TOL
    assert counter.calls == calls + 1
    assert wrapper.num_captured == 2
