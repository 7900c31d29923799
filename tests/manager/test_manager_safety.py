"""Outputs read after they were overwritten, and two threads in one manager.

Outputs alias graph memory until the next run. With
``ManagerOptions(check_overwritten_outputs=True)`` reading an earlier step's
output after a later replay raises (GPU); without it, the earlier output silently shows the
later step's numbers, which is why the check exists. A second thread calling
``run`` while one is inside it gets a clear error; the first step is unharmed.
"""

from __future__ import annotations

import threading
from typing import Final

import pytest
import torch

from cudagraph_capture._guard import OutputGuard
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, ManagerOptions

from .helpers import (
    INPUTS,
    SIZES,
    TOL,
    Backend,
    FakeEngines,
    ToyModel,
    config_for,
    make_batch,
    make_manager,
    rel_err,
)

FULL: Final = CUDAGraphMode.FULL


def _guarded(model: ToyModel, *, check: bool) -> CUDAGraphManager[torch.Tensor]:
    device = torch.device("cuda", torch.cuda.current_device())
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(FULL),
        device=device,
        options=ManagerOptions(check_overwritten_outputs=check),
    )
    manager.capture()
    return manager


@pytest.mark.gpu
def test_reading_an_overwritten_output_raises_with_the_check() -> None:
    model = ToyModel(torch.device("cuda"))
    manager = _guarded(model, check=True)
    device = manager.device
    first_batch = make_batch(5, 3, device, seed=0)
    first = manager.run_batch(first_batch)
    assert rel_err(first, model.eager(first_batch)) < TOL  # readable until the next replay
    second_batch = make_batch(6, 3, device, seed=1)  # the same graph (8 tokens)
    second = manager.run_batch(second_batch)
    with pytest.raises(RuntimeError, match=r"overwritten by a later replay .*clone\(\) the outputs you keep"):
        first.sum()
    assert rel_err(second, model.eager(second_batch)) < TOL
    third_batch = make_batch(20, 4, device, seed=2)  # another graph (24 tokens), same pool
    kept = second.clone()
    manager.run_batch(third_batch)
    with pytest.raises(RuntimeError, match="overwritten by a later replay"):
        second.sum()
    assert rel_err(kept, model.eager(second_batch)) < TOL  # a clone taken in time stays good


@pytest.mark.gpu
def test_without_the_check_an_old_output_shows_the_new_numbers() -> None:
    """The hazard the check catches: no error, just another step's values."""
    model = ToyModel(torch.device("cuda"))
    manager = _guarded(model, check=False)
    first_batch = make_batch(5, 3, manager.device, seed=0)
    first = manager.run_batch(first_batch)
    second_batch = make_batch(5, 3, manager.device, seed=1)
    second = manager.run_batch(second_batch)
    assert torch.equal(first, second)  # the same memory, now holding the second step
    assert rel_err(first, model.eager(first_batch)) > 1e-2


@pytest.mark.skipif(
    hasattr(torch._C, "_set_storage_access_error_msg"), reason="checks a torch build without the binding"
)
def test_the_check_needs_a_torch_build_that_can_mark_storages() -> None:
    with pytest.raises(
        ValueError, match=r"^options\.check_overwritten_outputs: OutputGuard: this torch build cannot mark"
    ):
        CUDAGraphManager(
            ToyModel(torch.device("cpu")),
            INPUTS,
            config_for(FULL),
            options=ManagerOptions(check_overwritten_outputs=True),
        )
    # The newcomer's 6: the guard built alone names itself, not a manager argument it does not have.
    with pytest.raises(ValueError, match=r"^OutputGuard: this torch build cannot mark storages"):
        OutputGuard()


def test_check_overwritten_outputs_must_be_a_bool() -> None:
    with pytest.raises(
        ValueError, match=r"^options\.check_overwritten_outputs: expected True or False, got 'yes'"
    ):
        ManagerOptions(check_overwritten_outputs="yes")  # type: ignore[arg-type]  # the wrong type is the point


@pytest.mark.parametrize("captured", [True, False], ids=["replay", "eager"])
def test_a_second_thread_inside_run_gets_a_clear_error(backend: Backend, captured: bool) -> None:
    model = ToyModel(backend.device)
    entered, release = threading.Event(), threading.Event()
    block = {"on": False}

    def blocking(**inputs: torch.Tensor) -> torch.Tensor:
        if block["on"]:
            entered.set()
            assert release.wait(timeout=30), "the test never released the first step"
        return model.eager(inputs)

    manager = make_manager(backend, blocking)
    if captured:
        manager.capture()
    first_batch = make_batch(5, 3, backend.device, seed=0)
    results: list[torch.Tensor] = []
    block["on"] = backend.name == "cpu" or not captured  # a real replay runs no Python: block eager steps
    if not block["on"]:
        pytest.skip("a CUDA replay runs no model Python to block in; the eager variant covers the lock")
    worker = threading.Thread(target=lambda: results.append(manager.run_batch(first_batch).clone()))
    worker.start()
    try:
        assert entered.wait(timeout=30)
        with pytest.raises(RuntimeError, match="another thread is inside run\\(\\)"):
            manager.run_batch(make_batch(6, 3, backend.device, seed=1))
    finally:
        release.set()
        worker.join(timeout=30)
    block["on"] = False
    assert not worker.is_alive()
    assert rel_err(results[0], model.eager(first_batch)) < TOL  # the first step was not disturbed
    after = make_batch(7, 3, backend.device, seed=2)
    assert rel_err(manager.run_batch(after), model.eager(after)) < TOL  # and the manager is free again


def test_clear_and_capture_wait_for_a_run_in_progress_and_a_run_meanwhile_is_refused() -> None:
    """capture()/clear() from another thread are serialized after a run(); a run() during them raises."""
    cpu = torch.device("cpu")
    model = ToyModel(cpu)
    entered, release = threading.Event(), threading.Event()
    block = {"run": False, "capture": False}

    def blocking(**inputs: torch.Tensor) -> torch.Tensor:
        if block["run"]:
            entered.set()
            assert release.wait(timeout=30), "the test never released the step"
        return model.eager(inputs)

    def hold_the_capture() -> None:
        if block["capture"]:
            entered.set()
            assert release.wait(timeout=30), "the test never released the capture"

    manager = CUDAGraphManager(
        blocking,
        INPUTS,
        config_for(CUDAGraphMode.FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(hold_the_capture)),
    )
    manager.capture()
    cleared = threading.Event()

    def clear_when_free() -> None:
        manager.clear()
        cleared.set()

    block["run"] = True
    stepping = threading.Thread(target=lambda: manager.run_batch(make_batch(3, 2, cpu, seed=0)))
    stepping.start()
    clearing: threading.Thread | None = None
    try:
        assert entered.wait(timeout=30)
        clearing = threading.Thread(target=clear_when_free)
        clearing.start()
        assert not cleared.wait(timeout=0.2), "clear() ran while a step was inside run()"
    finally:
        release.set()
        stepping.join(timeout=30)
        if clearing is not None:
            clearing.join(timeout=30)
    assert cleared.is_set()
    assert manager.num_captured == 0
    # Now a capture() holds the manager: a run() meanwhile is refused, not mixed into its buffers.
    block["run"], block["capture"] = False, True
    entered.clear()
    release.clear()
    capturing = threading.Thread(target=manager.capture)
    capturing.start()
    try:
        assert entered.wait(timeout=30)
        with pytest.raises(RuntimeError, match="another thread is inside run\\(\\), capture\\(\\)"):
            manager.run_batch(make_batch(4, 2, cpu, seed=1))
    finally:
        block["capture"] = False
        release.set()
        capturing.join(timeout=30)
    assert manager.num_captured == len(SIZES)
    batch = make_batch(5, 3, cpu, seed=2)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
