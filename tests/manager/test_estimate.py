"""``estimate_memory()``: what ``capture()`` will cost, predicted before it, leaving nothing behind.

On the GPU, for the reference decoder in each mode: the first estimate
leaves no graph and nothing in torch's cache (the driver keeps a few MiB of
the probes' executables for later graphs); then, in a warm process (after a
capture and a release, as after a wake), the estimate must be within
max(1.5%, 32 MiB) of the drop the capture's report measured
(``device_bytes``), and never more than 32 MiB under it. A fresh process is
``test_kv_sizing``'s. On the CPU the estimate says why it is 0.
"""

from __future__ import annotations

import math
from typing import Final

import pytest
import torch
from hypothesis import given

from cudagraph_capture import CaptureDisabledError, set_capture_enabled
from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager
from cudagraph_manager._estimate import probe_keys
from cudagraph_manager.examples.reference import (
    DecoderConfig,
    ReferenceDecoder,
    make_step_inputs,
    static_inputs,
)
from tests.strategies import plan_lengths

from .helpers import INPUTS, Backend, ToyModel, config_for, make_manager

MIB: Final = 2**20
#: The target: within max(1.5%, 32 MiB) of the measured drop, never more than 32 MiB under.
SHARE: Final = 0.015
SLACK: Final = 32 * MIB
GRANULE: Final = 2 * MIB
MODES: Final = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


def test_the_probes_are_the_largest_then_keys_spread_to_the_smallest(backend: Backend) -> None:
    manager = make_manager(backend, ToyModel(backend.device))
    keys = list(manager._keys.values())  # FULL over 7 sizes, largest first
    chosen = probe_keys(keys)
    assert chosen[0] is keys[0]
    assert chosen[-1] is keys[-1]  # the smallest is probed
    assert len(chosen) == 1 + 2
    many = keys * 10  # 70 keys: about 5% of the 69 after the largest
    assert len(probe_keys(many)) == 1 + 4


@given(plan_lengths)
def test_probes_are_few_spread_and_in_plan_order(n: int) -> None:
    """For every plan length: the largest first, then about 5% of the rest (at least 2), the smallest last."""
    keys = list(range(n))  # stand-ins for PlannedKeys, largest (0) first
    chosen = probe_keys(keys)
    assert chosen[0] == 0
    assert chosen == sorted(set(chosen))  # distinct, in capture order
    others = n - 1
    assert len(chosen) - 1 == min(others, max(2, math.ceil(0.05 * others)))
    if others >= 2:
        assert chosen[1] == 1  # the second largest: it often grows the pool once
        assert chosen[-1] == n - 1  # the smallest
    assert len(chosen) <= max(3, 0.06 * n + 2)  # a small share of the capture


def test_a_manager_without_cuda_graphs_estimates_nothing_and_says_why() -> None:
    cpu = CUDAGraphManager(
        ToyModel(torch.device("cpu")), INPUTS, config_for(CUDAGraphMode.FULL), device="cpu"
    )
    estimate = cpu.estimate_memory()
    assert estimate.total_bytes == 0
    assert estimate.probes == ()
    assert "CUDA" in str(estimate)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_the_estimate_predicts_the_capture_and_leaves_nothing_behind(mode: CUDAGraphMode) -> None:
    torch.manual_seed(0)
    decoder = DecoderConfig()  # 8 layers, d=1024, bf16
    model = ReferenceDecoder(decoder, device="cuda")
    config = DispatchConfig(mode, CaptureSizes.default(256), max_num_seqs=decoder.max_num_seqs)
    manager = CUDAGraphManager(model.forward, static_inputs(decoder), config)
    with torch.no_grad():  # an engine's profile step first: the kernels' first loads are not the graphs'
        profile = make_step_inputs(decoder, 256, uniform_decode=False, device="cuda")
        model(profile["input_ids"], profile["positions"], profile["slot_ids"])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved()
    free_before = torch.cuda.mem_get_info()[0]
    estimate = manager.estimate_memory()
    # Nothing left behind: no graph, nothing in torch's cache; the driver keeps the memory of the
    # probes' executables for later graphs (cuDeviceGraphMemTrim does not return it): 2 MiB each at most.
    assert manager.num_captured == 0
    assert torch.cuda.memory_reserved() <= reserved_before
    assert torch.cuda.mem_get_info()[0] >= free_before - GRANULE * (len(estimate.probes) + 1)
    assert estimate.num_graphs == sum(len(keys) for _, keys in manager.dispatcher.capture_plan())
    assert estimate.total_bytes == estimate.warmup_bytes + estimate.pool_bytes + estimate.driver_bytes
    assert len(estimate.probes) < estimate.num_graphs
    # The target holds in a warm process (as an engine's, or after a wake): warm this one up.
    manager.capture(progress=False)
    manager.release()
    estimate = manager.estimate_memory()
    report = manager.capture(progress=False)
    measured = report.device_bytes
    error = estimate.total_bytes - measured
    print(f"\n{mode.name}: {estimate}; measured {measured / MIB:.0f} MiB, error {error / MIB:+.1f} MiB")
    assert error >= -SLACK, f"the estimate is {-error / MIB:.1f} MiB under the capture's cost"
    assert abs(error) <= max(SHARE * measured, SLACK), (estimate.total_bytes, measured)
    manager.release()


@pytest.mark.gpu
def test_a_disabled_capture_is_refused_by_the_estimate_too() -> None:
    model = ToyModel(torch.device("cuda"))
    manager = CUDAGraphManager(model, INPUTS, config_for(CUDAGraphMode.FULL))
    set_capture_enabled(False)
    try:
        with pytest.raises(CaptureDisabledError):
            manager.estimate_memory()
    finally:
        set_capture_enabled(True)
    assert manager.estimate_memory().total_bytes > 0
