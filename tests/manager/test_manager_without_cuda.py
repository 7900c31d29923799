"""The manager's behaviour around its graphs: no CUDA, idle steps, eager steps counted and logged per reason.

Without CUDA (a CPU device and the default engines) the manager captures
nothing but still runs every step through its checks, dispatch, static
buffers and padding, then runs the model eagerly on the padded buffers: how
engine code is developed and unit-tested on a laptop. These tests run on the
CPU; the reasons and idle steps are the same on a GPU (``backend`` runs them
on both).
"""

from __future__ import annotations

import logging
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CUDAGraphMode, EagerReason
from cudagraph_manager import CUDAGraphManager, NoGraphError

from .helpers import (
    INPUTS,
    SIZES,
    TOL,
    Backend,
    ToyModel,
    config_for,
    make_batch,
    make_manager,
    rel_err,
)

CPU: Final = torch.device("cpu")
FULL: Final = CUDAGraphMode.FULL
PIECEWISE: Final = CUDAGraphMode.PIECEWISE


def _cpu_manager(
    model: ToyModel, mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE, *, strict: bool = False
) -> CUDAGraphManager[torch.Tensor]:
    return CUDAGraphManager(model, INPUTS, config_for(mode), device="cpu", strict=strict)


def test_capture_without_cuda_captures_nothing_and_says_why() -> None:
    manager = _cpu_manager(ToyModel(CPU))
    report = manager.capture()
    assert report.num_graphs == 0
    assert report.no_graphs is not None
    assert "CUDA graphs need a CUDA device" in report.no_graphs
    assert str(report).startswith("Captured no CUDA graphs: CUDA graphs need a CUDA device")
    assert manager.num_captured == 0


@pytest.mark.parametrize("mode", [FULL, PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_steps_without_cuda_run_eagerly_on_the_padded_buffers(mode: CUDAGraphMode) -> None:
    model = ToyModel(CPU)
    manager = _cpu_manager(model, mode)
    manager.capture()
    padded = 0
    for seed, (tokens, reqs, uniform) in enumerate(
        [(5, 3, False), (3, 3, True), (17, 9, False), (16, 16, True)]
    ):
        batch = make_batch(tokens, reqs, CPU, seed=seed)
        out = manager.run_batch(batch, uniform_decode=uniform)
        assert out.shape == (tokens, 32)
        assert rel_err(out, model.eager(batch)) < TOL
        decision = manager.dispatcher.dispatch(tokens, uniform_decode=uniform)
        assert decision.mode is not CUDAGraphMode.NONE
        padded += decision.descriptor.num_tokens - tokens
        # The step went through the static buffers: real rows, then pad values.
        ids = manager.static_buffers["ids"]
        assert torch.equal(ids[:tokens], batch["ids"])
        assert bool((ids[tokens : decision.descriptor.num_tokens] == 0).all())
    stats = manager.stats
    assert stats.num_replays == 0
    assert dict(stats.eager_reasons) == {EagerReason.NO_CUDA.value: 4}
    assert stats.eager_steps == 4
    assert stats.padded_tokens == padded > 0


def test_a_step_above_the_largest_size_runs_on_the_callers_tensors() -> None:
    model = ToyModel(CPU)
    manager = _cpu_manager(model)
    batch = make_batch(max(SIZES) + 3, 4, CPU, seed=1)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert dict(manager.stats.eager_reasons) == {EagerReason.ABOVE_LARGEST_SIZE.value: 1}
    assert manager.stats.padded_tokens == 0


def test_strict_without_cuda_raises_at_construction() -> None:
    with pytest.raises(
        ValueError, match=r"strict: CUDA graphs need a CUDA device, and the manager's device is cpu"
    ):
        _cpu_manager(ToyModel(CPU), strict=True)


def test_an_idle_step_returns_empty_outputs_without_a_model_call(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model)
    manager.capture()
    calls = model.request_scale.calls
    empty = manager.run_batch(make_batch(0, 0, backend.device, seed=0))
    assert empty.shape == (0, 32)
    assert empty.dtype == torch.float32
    assert model.request_scale.calls == calls  # the model did not run
    stats = manager.stats
    assert (stats.idle_steps, stats.eager_steps, stats.num_replays) == (1, 0, 0)
    batch = make_batch(5, 3, backend.device, seed=2)  # a normal step after it is unaffected
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL


def test_an_idle_step_before_any_output_learns_the_structure_once() -> None:
    model = ToyModel(CPU)
    manager = _cpu_manager(model)
    first = manager.run_batch(make_batch(0, 0, CPU, seed=0))
    assert first.shape == (0, 32)
    calls = model.request_scale.calls
    second = manager.run_batch(make_batch(0, 0, CPU, seed=1))
    assert second.shape == (0, 32)
    assert model.request_scale.calls == calls
    assert manager.stats.idle_steps == 2


def test_eager_steps_are_counted_and_logged_once_per_reason(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(
        backend, model, config=config_for(CUDAGraphMode.FULL_DECODE_ONLY, lora_counts=(1,))
    )
    uniform, no_modes = True, frozenset[CUDAGraphMode]()
    # (tokens, requests, uniform_decode, num_active_loras, invalid_modes)
    before_capture = [(4, 4, uniform, 0, no_modes), (4, 4, uniform, 0, no_modes)]  # not captured yet
    after_capture = [
        (max(SIZES) + 1, 4, False, 0, no_modes),  # above the largest size
        (max(SIZES) + 2, 4, False, 0, no_modes),
        (5, 3, False, 0, no_modes),  # mixed: no graph in FULL_DECODE_ONLY
        (4, 4, uniform, 2, no_modes),  # more adapters than captured
        (4, 4, uniform, 0, frozenset({FULL})),  # its FULL graph turned off
        (4, 4, uniform, 0, no_modes),  # replays
    ]
    with caplog.at_level(logging.INFO, logger="cudagraph_manager"):
        for seed, (tokens, reqs, decode, loras, invalid) in enumerate([*before_capture, *after_capture]):
            if seed == len(before_capture):
                manager.capture()
            batch = make_batch(tokens, reqs, backend.device, seed=seed)
            out = manager.run_batch(
                batch, uniform_decode=decode, num_active_loras=loras, invalid_modes=invalid
            )
            assert rel_err(out, model.eager(batch)) < TOL
    expected = {
        EagerReason.NOT_CAPTURED.value: 2,
        EagerReason.ABOVE_LARGEST_SIZE.value: 2,
        EagerReason.NO_GRAPH_FOR_BATCH.value: 1,
        EagerReason.LORA_COUNT.value: 1,
        EagerReason.INVALID_MODES.value: 1,
    }
    stats = manager.stats
    assert dict(stats.eager_reasons) == expected
    assert (stats.eager_steps, stats.uncaptured_steps, stats.num_replays) == (7, 2, 1)
    logged = [r.getMessage() for r in caplog.records if r.name == "cudagraph_manager"]
    assert len(logged) == len(expected)  # once per reason, however many steps
    for reason in expected:
        assert sum(f"({reason})" in m for m in logged) == 1, (reason, logged)


def test_strict_mode_names_the_reason(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, strict=True)
    manager.capture()
    with pytest.raises(NoGraphError, match=f"{max(SIZES) + 1} tokens exceed the largest capture size"):
        manager.run_batch(make_batch(max(SIZES) + 1, 4, backend.device, seed=0))
    assert manager.stats.eager_steps == 0


def test_check_weights_without_graphs_has_nothing_to_check() -> None:
    """No graph reads the weights, so replacing one is fine (it blamed "its CUDA graphs" before)."""
    model = ToyModel(CPU)
    manager = _cpu_manager(model)
    manager.capture()
    model.w1 = torch.nn.Parameter(model.w1.detach().clone(), requires_grad=False)  # replaced, not in place
    manager.check_weights()
    batch = make_batch(5, 3, CPU, seed=3)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
