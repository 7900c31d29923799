"""The ``GraphEngine`` road: ``warm_up`` runs the model, ``record`` captures without running anything.

``record`` is what lets a model runner capture while another thread serves
from the same pool and buffers, so its promise is checked where it could
break: a recording must write no memory at all (a scratch buffer the model
writes in every forward keeps a poisoned value; an eager break is not
called; the outputs of an earlier replay, in pool memory the recording may
be handed, keep their values), and the entry it returns, kept by the caller
alone, must then replay like eager on fresh random inputs. Both roads:
the wrappers' ``warm_up``/``record``, and ``graph_engine`` (the recorder
itself, ``cudagraph_manager``'s default engine). Last, what a runner's own
engine must hand back (the README's words, checked against the protocol).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal, cast

import pytest
import torch
from torch.nn.functional import linear

from cudagraph_capture import (
    BreakableCUDAGraphCapture,
    BreakableCUDAGraphWrapper,
    CaptureError,
    CaptureOptions,
    CUDAGraphWrapper,
    GraphEngine,
    GraphEntry,
    graph_engine,
)
from cudagraph_capture._pool import capture_stream
from cudagraph_capture._recorder import Entry
from cudagraph_capture.lowlevel import RecordSeconds
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
from tests.test_readmes import python_blocks

ENGINES: Final[tuple[Engine, ...]] = ("monolithic", "breakable")
#: The wrapper's ``warm_up``/``record``, or ``graph_engine``'s (no wrapper, no table).
Road = Literal["wrapper", "graph_engine"]
ROADS: Final[tuple[Road, ...]] = ("wrapper", "graph_engine")
#: The runtime mode ``graph_engine`` builds each engine for.
MODE: Final[dict[Engine, CUDAGraphMode]] = {
    "monolithic": CUDAGraphMode.FULL,
    "breakable": CUDAGraphMode.PIECEWISE,
}
README: Final = Path(__file__).resolve().parents[2] / "packages/capture/README.md"
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


def _engine(
    road: Road, engine: Engine, model: ScratchModel, options: CaptureOptions | None = None
) -> GraphEngine[torch.Tensor]:
    """The engine of ``road``: a wrapper, or ``graph_engine`` for the engine's mode."""
    if road == "wrapper":
        return _wrapper(engine, model, options)

    def runnable(*, x: torch.Tensor) -> torch.Tensor:
        return model.run(x)

    return graph_engine(runnable, MODE[engine], options)


def _assert_keeps_nothing(engine: GraphEngine[torch.Tensor], key: BatchDescriptor) -> None:
    """``record`` keeps nothing: a wrapper's table stays empty, ``graph_engine`` has none."""
    if isinstance(engine, CUDAGraphWrapper | BreakableCUDAGraphWrapper):
        assert not engine.is_captured(key), "record keeps nothing: the caller owns the entry"
        assert engine.num_captured == 0
    else:
        assert not hasattr(engine, "is_captured")


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("road", ROADS)
@pytest.mark.parametrize("engine", ENGINES)
def test_record_writes_nothing_and_the_entry_replays_like_eager(engine: Engine, road: Road) -> None:
    model = ScratchModel()
    wrapper = _engine(road, engine, model)
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
        _assert_keeps_nothing(wrapper, BatchDescriptor(16))
        assert entry.seconds.recording > 0.0
        assert entry.seconds.instantiation > 0.0  # the graph (or its segments) was built
        for _ in range(3):
            expected = model.run(fill_fresh_(x_buf)).clone()
            entry.replay()
            assert rel_err(entry.output, expected) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("road", ROADS)
@pytest.mark.parametrize("engine", ENGINES)
def test_record_leaves_a_held_replay_output_intact(engine: Engine, road: Road) -> None:
    """A smaller key recorded after a replay may get the replay's output memory: it must not write it."""
    model = ScratchModel()
    wrapper = _engine(road, engine, model)
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
@pytest.mark.parametrize("road", ROADS)
def test_a_breakable_entry_holds_its_segments_and_the_wrapper_keeps_none(road: Road) -> None:
    model = ScratchModel()
    wrapper = _engine(road, "breakable", model)
    x_buf = torch.randn(8, DIM, device=cuda())
    with torch.no_grad():
        model.run(x_buf)
        entry = wrapper.record(BatchDescriptor(8), {"x": x_buf})
    assert isinstance(entry, Entry)
    owner = entry.owner
    assert isinstance(owner, BreakableCUDAGraphCapture)
    assert (owner.num_graphs, owner.num_eager_breaks) == (2, 1)
    if road == "wrapper":
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
@pytest.mark.parametrize("road", ROADS)
@pytest.mark.parametrize("engine", ENGINES)
def test_warm_up_runs_the_model_eagerly_under_none(engine: Engine, road: Road) -> None:
    seen: list[tuple[CUDAGraphMode | None, bool]] = []
    weight = torch.randn(DIM, DIM, device=cuda())

    def runnable(*, x: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        seen.append(
            (None if context is None else context.runtime_mode, torch.cuda.is_current_stream_capturing())
        )
        return linear(x, weight)

    options = CaptureOptions(warmup_runs=2)
    wrapper: GraphEngine[torch.Tensor]
    if road == "graph_engine":
        wrapper = graph_engine(runnable, MODE[engine], options)
    elif engine == "monolithic":
        wrapper = CUDAGraphWrapper(runnable, CUDAGraphMode.FULL, options)
    else:
        wrapper = BreakableCUDAGraphWrapper(runnable, options)
    wrapper.warm_up(BatchDescriptor(4), {"x": torch.randn(4, DIM, device=cuda())})
    assert seen == [(CUDAGraphMode.NONE, False)] * 2
    _assert_keeps_nothing(wrapper, BatchDescriptor(4))


def test_record_and_warm_up_check_the_descriptor() -> None:
    wrapper = CUDAGraphWrapper(lambda **kw: kw, CUDAGraphMode.FULL)
    with pytest.raises(ValueError, match="descriptor: expected a BatchDescriptor, got 4"):
        wrapper.record(4, {})  # type: ignore[arg-type]  # the run-time check under test
    with pytest.raises(ValueError, match="descriptor: expected a BatchDescriptor, got 'x'"):
        wrapper.warm_up("x", {})  # type: ignore[arg-type]  # the run-time check under test


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("engine", ENGINES)
def test_graph_engine_refuses_a_recording_of_no_work_and_names_itself_in_a_failure(engine: Engine) -> None:
    """A model on the CPU records nothing (refused: replaying it would hand back stale outputs)."""
    # CPU work only: a copy of the CUDA input to the host would itself fail inside a capture.
    cpu = graph_engine(lambda *, x: torch.full((4,), 2.0), MODE[engine], CaptureOptions(warmup_runs=0))
    with pytest.raises(CaptureError, match=r"recorded no CUDA work.*num_tokens=4"):
        cpu.record(BatchDescriptor(4), {"x": torch.ones(4, device=cuda())})

    def failing(*, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    broken = graph_engine(failing, MODE[engine])
    name = f"graph_engine({MODE[engine].name})"
    with pytest.raises(CaptureError, match=rf"^{re.escape(name)}: capture failed with RuntimeError: boom"):
        broken.record(BatchDescriptor(4), {"x": torch.ones(4, device=cuda())})


# -- without a GPU: the arguments, and what a runner's own engine must hand back --


@pytest.mark.parametrize(
    ("mode", "pattern"),
    [
        (CUDAGraphMode.NONE, r"^mode: expected FULL or PIECEWISE, got <CUDAGraphMode.NONE"),
        (CUDAGraphMode.FULL_AND_PIECEWISE, r"^mode: expected FULL or PIECEWISE, got <CUDAGraphMode.FULL_AND"),
        ("FULL", r"^mode: expected FULL or PIECEWISE, got 'FULL'$"),
    ],
)
def test_graph_engine_names_a_mode_it_does_not_build(mode: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        graph_engine(lambda **kw: kw, cast("CUDAGraphMode", mode))


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE], ids=lambda m: m.name)
def test_graph_engine_names_a_bad_runnable_or_options(mode: CUDAGraphMode) -> None:
    with pytest.raises(ValueError, match=r"^runnable: expected a callable, got 3$"):
        graph_engine(cast("Callable[..., object]", 3), mode)
    with pytest.raises(ValueError, match=r"^options: expected CaptureOptions or None, got 'fast'$"):
        graph_engine(lambda **kw: kw, mode, cast("CaptureOptions", "fast"))


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE], ids=lambda m: m.name)
@pytest.mark.parametrize("method", ["warm_up", "record"])
@pytest.mark.parametrize(
    ("descriptor", "inputs", "pattern"),
    [
        (4, {}, r"^descriptor: expected a BatchDescriptor, got 4$"),
        (8, None, r"^descriptor: expected a BatchDescriptor, got 8$"),  # the descriptor first
        (BatchDescriptor(4), [torch.zeros(1)], r"^inputs: expected a mapping .*got \["),
        (BatchDescriptor(4), {0: torch.zeros(1)}, r"^inputs: expected keyword names \(str\), got 0$"),
        (BatchDescriptor(4), {"x": [1.0]}, r"^inputs\['x'\]: expected a torch.Tensor, got list$"),
    ],
)
def test_graph_engine_checks_its_arguments_before_anything_asks_for_cuda(
    mode: CUDAGraphMode, method: str, descriptor: object, inputs: object, pattern: str
) -> None:
    """The wrappers' checks, on the manager's road: one copy, in the recorder both roads call."""
    calls: list[object] = []
    engine = graph_engine(lambda **kw: calls.append(kw), mode)
    with pytest.raises(ValueError, match=pattern):
        getattr(engine, method)(descriptor, inputs)
    assert calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no CUDA device")
@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE], ids=lambda m: m.name)
def test_graph_engine_without_cuda_says_a_device_is_needed(mode: CUDAGraphMode) -> None:
    engine = graph_engine(lambda *, x: x, mode)
    name = re.escape(f"graph_engine({mode.name})")
    needs = rf"^{name} needs a CUDA device, and none is available"
    with pytest.raises(CaptureError, match=rf"{needs}.*num_tokens=4"):
        engine.record(BatchDescriptor(4), {"x": torch.ones(4)})
    with pytest.raises(RuntimeError, match=rf"{needs} here"):
        engine.warm_up(BatchDescriptor(4), {"x": torch.ones(4)})


def _readme_entry_members() -> list[str]:
    """The members the README says a runner's own engine's entry has: its list after "exactly these"."""
    text = README.read_text()
    start = text.index("exactly these three members")
    listed = text[start : text.index("\n\n", text.index("\n\n", start) + 2)]
    return re.findall(r"^- `(\w+)`", listed, flags=re.MULTILINE)


def test_the_readmes_entry_is_the_protocol_and_its_own_engines_entry_has_it() -> None:
    """Issue 33: what the README says an entry needs is ``GraphEntry``, and the entries built from it have it.

    ``tests/test_readmes.py`` runs the README's engine under a manager; here
    its entry, built as written, is held to the README's list one member at
    a time, and so is the concrete entry of ``graph_engine`` and the wrappers.
    """
    members = _readme_entry_members()
    assert members == ["replay", "output", "seconds"]
    assert set(members) == {name for name in vars(GraphEntry) if not name.startswith("_")}
    assert set(members) <= {field.name for field in dataclasses.fields(Entry)}
    (code,) = [b for b in python_blocks(README) if "class RerunEngine" in b]
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)
    weight = torch.randn(4, 4)
    x = torch.randn(2, 4)
    engine_class = cast("Callable[..., GraphEngine[torch.Tensor]]", namespace["RerunEngine"])
    engine = engine_class(lambda *, x: x @ weight, CUDAGraphMode.FULL, CaptureOptions())
    engine.warm_up(BatchDescriptor(2), {"x": x})
    entry = engine.record(BatchDescriptor(2), {"x": x})
    replay, output, seconds = (getattr(entry, name) for name in members)
    assert isinstance(seconds, RecordSeconds)
    assert seconds.recording >= 0.0
    assert seconds.instantiation == 0.0
    x.copy_(torch.randn(2, 4))  # the static input, refilled
    replay()
    assert entry.output is output, "a replay rewrites the outputs in place"
    torch.testing.assert_close(output, x @ weight)
