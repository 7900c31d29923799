"""The manager's device: the CPU however it is written, and a model that must live there.

Issue 39: ``device='cpu:0'`` was kept as given, so every valid step (its
tensors on ``cpu``) was refused as "on another device"; the CPU written
with an index is the CPU. A model whose weights live elsewhere (``meta``, or
wholly on another device) is named at construction, not by torch's
cross-device error inside the first step. Bad device values: rows of
``tests/test_bad_inputs.py``.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch
from torch import nn

from cudagraph_capture.lowlevel import resolve_device
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, ManagerOptions

from .helpers import INPUTS, TOL, FakeEngines, ToyModel, config_for, make_batch, rel_err

CPU: Final = torch.device("cpu")


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0), torch.device("cpu:0"), "cpu"])
def test_the_cpu_written_with_index_0_is_the_cpu(device: object) -> None:
    assert resolve_device(device) == CPU  # type: ignore[arg-type]  # each spelling under test
    model = ToyModel(CPU)
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(CUDAGraphMode.FULL),
        device=device,  # type: ignore[arg-type]
        options=ManagerOptions(engine_factory=FakeEngines()),
    )
    assert manager.device == CPU
    for seed, tokens in enumerate((5, 40)):  # eager before capture and above the largest size
        batch = make_batch(tokens, 3, CPU, seed=seed)
        assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    manager.capture(progress=False)
    batch = make_batch(5, 3, CPU, seed=3)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL


class _MetaBuffer(nn.Module):
    """A CPU model with one buffer left on meta (a half-loaded checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.toy = ToyModel(CPU)
        self.register_buffer("table", torch.empty(4, device="meta"))

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.toy(**inputs)  # type: ignore[no-any-return]


def test_a_model_with_one_buffer_on_meta_is_named() -> None:
    with pytest.raises(ValueError, match=r"^model: its buffer 'table' is on meta \(it holds no data\)"):
        CUDAGraphManager(_MetaBuffer(), INPUTS, config_for(CUDAGraphMode.FULL), device="cpu")


def test_a_bound_method_of_a_meta_model_is_named() -> None:
    model = ToyModel(torch.device("meta"))
    with pytest.raises(ValueError, match=r"^model: its parameter 'embed' is on meta"):
        CUDAGraphManager(model.forward, INPUTS, config_for(CUDAGraphMode.FULL), device="cpu")


class _NoWeights(nn.Module):
    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return inputs["x"] * 2


def test_a_function_model_and_a_model_without_weights_are_not_checked() -> None:
    def double(**inputs: torch.Tensor) -> torch.Tensor:
        return inputs["x"] * 2

    for model in (double, _NoWeights()):
        CUDAGraphManager(model, INPUTS, config_for(CUDAGraphMode.FULL), device="cpu")


@pytest.mark.gpu
def test_a_cuda_manager_accepts_a_model_with_some_weights_kept_on_the_cpu() -> None:
    """Some weights offloaded to the host is a choice a model may make; all of them elsewhere is a mistake."""
    model = ToyModel(torch.device("cuda"))
    model.register_buffer("host_table", torch.zeros(4))  # on the CPU, the rest on CUDA
    CUDAGraphManager(model, INPUTS, config_for(CUDAGraphMode.FULL), device="cuda")
