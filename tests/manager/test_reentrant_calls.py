"""Calls on a manager from inside its own step: refused at once, naming the call; the manager stays usable.

A model, an attention builder or a decode loop's ``advance`` runs while its
manager holds the static buffers (a step, a capture); a call there that
needs them too (``run``, ``capture``, ``release``, ...) would wait for
itself. Each is refused with a ``RuntimeError`` saying so, the outer call
completes (the error caught) or fails with it (the error raised through),
and the next call from outside works. The capture thread of a background
capture is refused the same way; another thread keeps the busy behaviour.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Mapping
from typing import Final

import pytest
import torch

from cudagraph_capture import CaptureError
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager import CUDAGraphManager, DecodeLoop, LoopState, ManagerOptions
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch
from tests.manager.helpers import (
    INPUTS,
    TOL,
    FakeEngines,
    RequestScale,
    ToyModel,
    config_for,
    make_batch,
    rel_err,
)
from tests.manager.test_run_loop import INPUTS as LOOP_INPUTS
from tests.manager.test_run_loop import ToyDecoder, advance, python_loop

CPU: Final = torch.device("cpu")
M: Final = CUDAGraphMode
Manager = CUDAGraphManager[torch.Tensor]
#: Seconds an outer call may take: today's deadlock would block forever.
DEADLINE_S: Final = 30.0


def _loop_batch() -> dict[str, torch.Tensor]:
    return {"ids": torch.tensor([5, 13, 45]), "scale": torch.tensor([2, 3, 1])}


#: Every call that needs the static buffers, as made from inside a step of the manager.
CALLS: Final[dict[str, Callable[[Manager], object]]] = {
    "run": lambda m: m.run(**_batch_for(m)),  # type: ignore[arg-type]  # mypy reads ** as run()'s keywords
    "run_batch": lambda m: m.run_batch(_batch_for(m)),
    "run_loop": lambda m: m.run_loop(_loop_batch(), max_steps=2),
    "capture": lambda m: m.capture(progress=False),
    "clear": lambda m: m.clear(),
    "release": lambda m: m.release(),
    "start_capture": lambda m: m.start_capture(),
    "estimate_memory": lambda m: m.estimate_memory(),
}


def _batch_for(manager: Manager) -> dict[str, torch.Tensor]:
    """A valid small step of ``manager``'s inputs (the toy model's or the loop decoder's)."""
    if "x" in manager.static_buffers:
        return make_batch(2, 2, CPU, seed=9)
    return _loop_batch()


def _inside(name: str) -> str:
    return rf"^{re.escape(name)}\(\): called from inside a step of this manager"


class Hook:
    """Calls ``CALLS[name]`` on the manager when armed, once; keeps the error it raised, or raises it."""

    def __init__(self) -> None:
        self.manager: Manager | None = None
        self.name: str | None = None
        self.propagate = False
        self.errors: list[BaseException] = []

    def arm(self, manager: Manager, name: str, *, propagate: bool = False) -> None:
        self.manager, self.name, self.propagate = manager, name, propagate

    def __call__(self) -> None:
        manager, name = self.manager, self.name
        if manager is None or name is None:
            return
        self.name = None  # once: the outer call runs the model again freely
        try:
            CALLS[name](manager)
        except RuntimeError as error:
            self.errors.append(error)
            if self.propagate:
                raise
        else:
            raise AssertionError(f"{name}() from inside a step was accepted")


class HookedModel(ToyModel):
    """``ToyModel`` calling its hook first, on every path that runs the model."""

    def __init__(self, hook: Hook) -> None:
        super().__init__(CPU)
        self.hook = hook

    def forward(
        self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        self.hook()
        return super().forward(ids, x, scale, bias)


@dataclasses.dataclass(frozen=True)
class _Metadata:
    shape: BatchShape


class HookedBuilder:
    """An attention builder whose ``build`` calls the hook (the model reads nothing of it)."""

    def __init__(self, hook: Hook) -> None:
        self.hook = hook
        self.support = AttentionSupport(GraphSupport.ALWAYS, name="hooked")

    def build(self, batch: StepBatch, shape: BatchShape, /) -> _Metadata:
        self.hook()
        return _Metadata(shape)

    def build_for_capture(self, shape: BatchShape, /) -> _Metadata:
        return _Metadata(shape)


def _manager(
    model: ToyModel, *, fakes: bool = True, builder: HookedBuilder | None = None
) -> tuple[Manager, FakeEngines | None]:
    """A CPU manager of ``model``: with fake engines (graphs to replay), or none (no CUDA: padded eager)."""
    engines = FakeEngines() if fakes else None
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(M.FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=engines, attention=AttentionOptions(metadata_builder=builder)),
    )
    return manager, engines


def _within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()`` on a thread of its own, which must end within ``seconds`` (a deadlock fails, not hangs)."""
    result: list[object] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as error:  # handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call deadlocked"
    if errors:
        raise errors[0]
    return result[0]


#: Where the model runs during a step: an eager step (not captured), a replay (the fake
#: engine's replay reruns the model), and a padded eager step without CUDA.
PATHS: Final = ("eager", "replay", "no_cuda")
#: The calls a model of ``ToyModel``'s inputs makes (``run_loop`` needs a decode loop: below).
MODEL_CALLS: Final = tuple(name for name in CALLS if name != "run_loop")


def _stepping(path: str, hook: Hook) -> tuple[Manager, HookedModel]:
    model = HookedModel(hook)
    manager, _ = _manager(model, fakes=path != "no_cuda")
    if path == "replay":
        manager.capture(progress=False)
    return manager, model


def _assert_usable(manager: Manager, model: ToyModel, seed: int) -> None:
    """The manager is free again: a step from outside runs and equals eager."""
    assert not manager.busy
    batch = make_batch(5, 3, CPU, seed=seed)
    assert rel_err(_within(DEADLINE_S, lambda: manager.run_batch(batch)), model.eager(batch)) < TOL  # type: ignore[arg-type]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", MODEL_CALLS)
def test_a_call_from_the_model_is_refused_and_the_step_completes(path: str, name: str) -> None:
    hook = Hook()
    manager, model = _stepping(path, hook)
    batch = make_batch(5, 3, CPU, seed=1)
    hook.arm(manager, name)
    out = _within(DEADLINE_S, lambda: manager.run_batch(batch).clone())
    assert len(hook.errors) == 1
    with pytest.raises(RuntimeError, match=_inside(name)):
        raise hook.errors[0]
    assert "the model, attention builder or decode loop's advance" in str(hook.errors[0])
    assert isinstance(out, torch.Tensor)
    assert rel_err(out, model.eager(batch)) < TOL
    _assert_usable(manager, model, seed=2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", MODEL_CALLS)
def test_a_call_from_the_model_fails_the_step_cleanly(path: str, name: str) -> None:
    hook = Hook()
    manager, model = _stepping(path, hook)
    stats = manager.stats
    hook.arm(manager, name, propagate=True)
    with pytest.raises(RuntimeError, match=_inside(name)):
        _within(DEADLINE_S, lambda: manager.run_batch(make_batch(5, 3, CPU, seed=1)))
    assert manager.stats == stats  # the failed step is not counted
    _assert_usable(manager, model, seed=3)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "replay"])
@pytest.mark.parametrize("name", MODEL_CALLS)
def test_a_call_from_the_builder_is_refused(captured: bool, name: str) -> None:
    hook = Hook()
    model = ToyModel(CPU)
    manager, _ = _manager(model, builder=HookedBuilder(hook))
    if captured:
        manager.capture(progress=False)
    hook.arm(manager, name, propagate=True)
    with pytest.raises(RuntimeError, match=_inside(name)):
        _within(DEADLINE_S, lambda: manager.run_batch(make_batch(5, 3, CPU, seed=1)))
    _assert_usable(manager, model, seed=4)


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_from_advance_is_refused_and_the_loop_runs_after(name: str) -> None:
    hook = Hook()

    def hooked(logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState) -> None:
        hook()
        advance(logits, inputs, state)

    engines = FakeEngines()
    manager = CUDAGraphManager(
        ToyDecoder(),
        LOOP_INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8), max_num_seqs=8),
        device="cpu",
        options=ManagerOptions(engine_factory=engines, decode_loop=DecodeLoop(hooked, max_steps=4)),
    )
    manager.capture(progress=False)
    hook.arm(manager, name, propagate=True)
    with pytest.raises(RuntimeError, match=_inside(name)):
        _within(DEADLINE_S, lambda: manager.run_loop(_loop_batch(), max_steps=4))
    assert not manager.busy
    result = _within(DEADLINE_S, lambda: manager.run_loop(_loop_batch(), max_steps=4))
    assert result.tokens.tolist() == python_loop([5, 13, 45], [2, 3, 1], 4)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", MODEL_CALLS)
def test_a_call_from_the_model_during_capture_fails_the_capture_cleanly(name: str) -> None:
    hook = Hook()
    model = HookedModel(hook)
    manager, _ = _manager(model)
    hook.arm(manager, name, propagate=True)
    with pytest.raises(CaptureError) as info:  # the capture's error names the key, the cause is ours
        _within(DEADLINE_S, lambda: manager.capture(progress=False))
    assert len(hook.errors) == 1
    assert re.search(_inside(name), str(hook.errors[0]))
    assert str(hook.errors[0]) in str(info.value)
    assert not manager.busy
    _within(DEADLINE_S, lambda: manager.capture(progress=False))  # captures the keys left
    _assert_usable(manager, model, seed=5)


@pytest.mark.parametrize("name", MODEL_CALLS)
def test_a_call_from_the_model_on_the_background_capture_thread_is_refused(name: str) -> None:
    hook = Hook()
    model = HookedModel(hook)
    manager, _ = _manager(model)
    hook.arm(manager, name, propagate=True)
    handle = manager.start_capture()
    _within(DEADLINE_S, lambda: handle.wait(DEADLINE_S))
    assert len(hook.errors) == 1
    assert re.search(
        rf"^{re.escape(name)}\(\): called from inside this manager's background capture",
        str(hook.errors[0]),
    ), str(hook.errors[0])
    assert not manager.busy
    _assert_usable(manager, model, seed=6)


def test_another_thread_still_gets_the_busy_error_not_the_reentrant_one() -> None:
    entered, release = threading.Event(), threading.Event()
    model = ToyModel(CPU)

    def blocking(**inputs: torch.Tensor) -> torch.Tensor:
        entered.set()
        assert release.wait(DEADLINE_S)
        return model.eager(inputs)

    manager = CUDAGraphManager(blocking, INPUTS, config_for(M.FULL), device="cpu")
    worker = threading.Thread(target=lambda: manager.run_batch(make_batch(3, 2, CPU, seed=0)), daemon=True)
    worker.start()
    try:
        assert entered.wait(DEADLINE_S)
        for step in (CALLS["run"], CALLS["run_batch"]):
            with pytest.raises(RuntimeError, match=r"another thread is inside run\(\)") as info:
                step(manager)
            assert "from inside a step" not in str(info.value)
    finally:
        release.set()
        worker.join(DEADLINE_S)
    assert not worker.is_alive()
    _assert_usable(manager, model, seed=7)


class _HookedScale(RequestScale):
    """``ToyModel``'s eager break calling the hook first: a PIECEWISE replay runs it on a GPU."""

    def __init__(self, hook: Hook) -> None:
        self.hook = hook
        super().__init__()

    def _apply(self, out: torch.Tensor, h: torch.Tensor, scale: torch.Tensor) -> None:
        self.hook()
        super()._apply(out, h, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("propagate", [False, True], ids=["caught", "raised"])
@pytest.mark.parametrize("name", ["run_batch", "capture", "release"])
def test_a_call_from_an_eager_break_of_a_cuda_piecewise_replay_is_refused(name: str, propagate: bool) -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    hook = Hook()
    model = ToyModel(cuda)
    model.request_scale = _HookedScale(hook)
    manager = CUDAGraphManager(model, INPUTS, config_for(M.PIECEWISE), device=cuda)
    manager.capture(progress=False)
    captured = manager.num_captured
    batch = make_batch(5, 3, cuda, seed=1)
    hook.arm(manager, name, propagate=propagate)
    if propagate:
        with pytest.raises(RuntimeError, match=_inside(name)):
            _within(DEADLINE_S, lambda: manager.run_batch(batch))
    else:
        out = _within(DEADLINE_S, lambda: manager.run_batch(batch).clone())
        assert rel_err(out, model.eager(batch)) < TOL  # type: ignore[arg-type]
    assert len(hook.errors) == 1
    assert manager.num_captured == captured  # nothing was released or captured
    after = make_batch(6, 2, cuda, seed=2)
    assert rel_err(_within(DEADLINE_S, lambda: manager.run_batch(after)), model.eager(after)) < TOL  # type: ignore[arg-type]
    assert manager.stats.num_replays >= 1
