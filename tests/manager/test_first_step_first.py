"""The first step goes first: a background capture records nothing until the first step after it is served.

On the CPU with the fake engines, whose recordings run on the capture
worker and call ``on_capture`` first. The serving thread's step is made
long (it blocks on an event) so that a recording started during it would
be seen. The GPU figure this buys (the wake's first step) is in
``tests/benchmarks/test_bench_sleep.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import BackgroundCapture, CUDAGraphManager, ManagerOptions
from cudagraph_manager._graphs._thread import BackgroundTimings

from .helpers import INPUTS, TOL, FakeEngines, ToyModel, config_for, make_batch, rel_err

CPU: Final = torch.device("cpu")
WAIT_S: Final = 30.0
#: How long a test watches for a recording that must not start.
QUIET_S: Final = 0.2
#: How soon a capture let go must finish (its fake recordings take microseconds; the first-step
#: waits these tests give are ``WAIT_S`` and longer, so a capture that only timed out fails this).
SOON_S: Final = 10.0


class HeldSteps(ToyModel):
    """A toy model whose calls on one thread (the serving thread's steps) wait for ``release``."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.serving: int | None = None  # the serving thread's ident, once known
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(
        self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        if threading.get_ident() == self.serving:
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return super().forward(ids, x, scale, bias)


class Recordings:
    """An ``on_capture`` hook counting recordings."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def _manager(
    model: ToyModel, hook: Recordings, timings: BackgroundTimings | None = None
) -> CUDAGraphManager[torch.Tensor]:
    """A manager on the fake engines; its background captures wait for the first step as ``timings`` say."""
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(CUDAGraphMode.FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(hook)),
    )
    if timings is not None:
        manager._capturer.background_timings = timings
    return manager


def _serve_in_thread(
    manager: CUDAGraphManager[torch.Tensor], model: HeldSteps, num_tokens: int, seed: int
) -> tuple[threading.Thread, list[torch.Tensor]]:
    """Start one step of ``num_tokens`` on a new thread (the serving thread); its output lands in the list."""
    batch = make_batch(num_tokens, 2, CPU, seed=seed)
    outputs: list[torch.Tensor] = []

    def serve() -> None:
        model.serving = threading.get_ident()
        outputs.append(manager.run_batch(batch).clone())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert model.entered.wait(WAIT_S), "the step never reached the model"
    return thread, outputs


def _done_soon(handle: BackgroundCapture, timeout: float) -> bool:
    """Poll ``done`` (``wait()`` would itself let the first recording go)."""
    deadline = time.monotonic() + timeout
    while not handle.done and time.monotonic() < deadline:
        time.sleep(0.005)
    return handle.done


def test_the_first_recording_waits_for_the_first_step() -> None:
    model, recordings = HeldSteps(), Recordings()
    manager = _manager(model, recordings, BackgroundTimings(first_step_wait_s=WAIT_S))  # only the step
    handle = manager.start_capture()
    thread, outputs = _serve_in_thread(manager, model, 5, seed=0)
    time.sleep(QUIET_S)  # the step is in flight on the host: nothing may be recorded meanwhile
    assert recordings.count == 0
    model.release.set()
    thread.join(WAIT_S)
    # Well before the first-step wait ends: the step's end, not the timeout, let the recordings go.
    assert _done_soon(handle, SOON_S), "the step is done: the capture must go on"
    assert recordings.count == len(manager.dispatcher.keys(CUDAGraphMode.FULL)) == handle.progress[1]
    model.serving = None
    assert rel_err(outputs[0], model.eager(make_batch(5, 2, CPU, seed=0))) < TOL


def test_without_a_step_the_capture_starts_after_the_first_step_wait() -> None:
    recordings = Recordings()
    manager = _manager(ToyModel(CPU), recordings)
    handle = manager.start_capture()
    assert _done_soon(handle, WAIT_S)
    assert recordings.count == handle.progress[1] > 0


@pytest.mark.parametrize("how", ["wait", "stop"])
def test_wait_and_stop_let_the_first_recording_go_at_once(how: str) -> None:
    recordings = Recordings()
    never = BackgroundTimings(first_step_wait_s=10 * WAIT_S)  # never reached in this test
    manager = _manager(ToyModel(CPU), recordings, never)
    handle = manager.start_capture()
    if how == "wait":
        assert handle.wait(WAIT_S).num_graphs == recordings.count > 0
    else:
        handle.stop()
        assert handle.wait(WAIT_S).num_graphs == recordings.count == 0
