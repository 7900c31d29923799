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

import itertools
import math
from typing import Final

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cudagraph_capture import CaptureDisabledError, set_capture_enabled
from cudagraph_capture._enabled import capture_disabled_reason
from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager
from cudagraph_manager._graphs._estimate import (
    MIN_PROBES,
    PREDICTED_PROBES,
    PROBE_SHARE,
    RULE,
    PoolUse,
    extrapolate,
    pick_probes,
    predict_pool,
)
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from tests.strategies import plan_sizes

from .helpers import INPUTS, Backend, ToyModel, config_for, make_manager

MIB: Final = 2**20
#: The target: within max(1.5%, 32 MiB) of the measured drop, never more than 32 MiB under.
SHARE: Final = 0.015
SLACK: Final = 32 * MIB
GRANULE: Final = 2 * MIB
MODES: Final = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


def test_the_probes_are_the_largest_then_keys_spread_to_the_smallest(backend: Backend) -> None:
    manager = make_manager(backend, ToyModel(backend.device))
    ((_, keys),) = manager.dispatcher.capture_plan()  # FULL over 7 sizes, largest first
    chosen = pick_probes(keys, lambda key: key.num_tokens)
    assert chosen[0] is keys[0]
    assert chosen[-1] is keys[-1]  # the smallest is probed
    assert len(chosen) == 1 + 2


def test_the_probes_of_the_default_plan_are_spread_in_tokens() -> None:
    sizes = sorted(CaptureSizes.default(2048).sizes, reverse=True)  # 147, dense below 256
    chosen = pick_probes(sizes, lambda size: size)
    assert len(chosen) == 1 + math.ceil(PROBE_SHARE * (len(sizes) - 1))
    gaps = [a - b for a, b in itertools.pairwise(chosen[1:])]
    assert max(gaps) <= 2 * min(gaps)  # even in tokens, where an even spread in keys would not be
    assert sum(size <= 256 for size in chosen) <= 2


@given(plan_sizes)
def test_probes_are_few_spread_and_in_plan_order(sizes: list[int]) -> None:
    """For every plan: the largest first, then about 8% of the rest (at least 2) spread over their sizes.

    Keys are positions in the plan (several may share a size): the second and
    the last key are probed by position, the last being the one warmed up.
    """
    keys = list(range(len(sizes)))
    chosen = pick_probes(keys, sizes.__getitem__)
    assert chosen[0] == 0
    assert chosen == sorted(set(chosen))  # distinct, in capture order
    others = len(keys) - 1
    k = min(others, max(MIN_PROBES, math.ceil(PROBE_SHARE * others)))
    assert len(chosen) - 1 == k
    if k < 2:
        return
    assert chosen[1] == 1  # the second largest: it often grows the pool once
    assert chosen[-1] == keys[-1]  # the last key of the smallest size
    widest = max(a - b for a, b in itertools.pairwise(sizes[1:]))
    spacing = (sizes[1] - sizes[-1]) / (k - 1)
    if spacing >= 2 * widest:  # room for a key near every target: each pick is its target's nearest
        targets = [sizes[1] - i * spacing for i in range(k)]
        picked = [sizes[key] for key in chosen[1:]]
        near = widest / 2 + 1e-6  # a tie between two keys may go either way in floating point
        assert all(abs(pick - target) <= near for pick, target in zip(picked, targets, strict=True))
        assert all(a - b <= spacing + widest for a, b in itertools.pairwise(picked))


def test_several_keys_of_the_smallest_size_probe_the_last() -> None:
    """LoRA counts give a size several keys: the plan's last key is the probe that is warmed up."""
    sizes = [size for size in sorted(CaptureSizes.default(512).sizes, reverse=True) for _ in range(3)]
    keys = list(range(len(sizes)))
    chosen = pick_probes(keys, sizes.__getitem__)
    assert chosen[-1] == keys[-1]
    assert chosen[1] == 1


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
        model(profile["input_ids"], profile["positions"], profile["cache_rows"])
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
    """Refused before anything is probed: no key named, no graph, no memory; the next estimate is whole."""
    model = ToyModel(torch.device("cuda"))
    manager = CUDAGraphManager(model, INPUTS, config_for(CUDAGraphMode.FULL))
    ((_, keys),) = manager.dispatcher.capture_plan()  # FULL over 7 sizes, largest first
    reserved = torch.cuda.memory_reserved()
    set_capture_enabled(False)
    try:
        why = capture_disabled_reason()
        with pytest.raises(CaptureDisabledError) as caught:
            manager.estimate_memory()
    finally:
        set_capture_enabled(True)
    assert why is not None
    assert str(caught.value) == why  # the estimate as a whole is refused: no descriptor appended
    assert caught.value.descriptor is None
    assert manager.num_captured == 0
    assert torch.cuda.memory_reserved() <= reserved  # nothing allocated: no probe pool, no warm-up
    estimate = manager.estimate_memory()  # the refusal left nothing behind: every key, the usual probes
    assert estimate.no_graphs is None
    assert estimate.num_graphs == len(keys)
    probed = keys[:PREDICTED_PROBES] if RULE == "predicted" else pick_probes(keys, lambda key: key.num_tokens)
    assert [probe.descriptor for probe in estimate.probes] == probed
    assert estimate.total_bytes == estimate.warmup_bytes + estimate.pool_bytes + estimate.driver_bytes
    assert manager.num_captured == 0


#: Probes' (pool, driver) bytes: pool growth can be negative (torch's cache shrank), driver in 2 MiB steps.
_probe_bytes = st.tuples(st.integers(-(2**22), 2**32), st.integers(0, 64).map(lambda n: n * GRANULE))


@given(st.lists(_probe_bytes, min_size=1, max_size=12), st.integers(0, 400))
def test_extrapolate_counts_the_probes_as_measured_and_charges_each_other_key_alike(
    measured: list[tuple[int, int]], extra: int
) -> None:
    """``extrapolate``, pure: the probes as measured; each unprobed key the same non-negative charge."""
    pool, driver = extrapolate(measured, len(measured))
    assert (pool, driver) == (sum(p for p, _ in measured), sum(d for _, d in measured))
    more_pool, more_driver = extrapolate(measured, len(measured) + extra)
    if len(measured) <= 2 or extra == 0:  # no probe past the two largest: nothing to charge from
        assert (more_pool, more_driver) == (pool, driver)
        return
    charge = max(0, min(p for p, _ in measured[2:]))
    assert more_pool == pool + extra * charge
    assert more_driver == driver + extra * (driver // len(measured))
    assert more_pool >= pool
    assert more_driver >= driver


def test_extrapolate_of_no_probe_is_nothing() -> None:
    assert extrapolate([], 5) == (0, 0)


@pytest.mark.gpu
def test_an_estimate_warms_each_key_up_once_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a recapture the capture warms each mode's smallest key: the estimate runs it once, not twice."""
    from cudagraph_manager._graphs import _estimate, _recording

    decoder = DecoderConfig(num_layers=2)
    model = ReferenceDecoder(decoder, device="cuda")
    config = DispatchConfig(
        CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(64), max_num_seqs=decoder.max_num_seqs
    )
    manager = CUDAGraphManager(model.forward, static_inputs(decoder), config)
    with torch.no_grad():
        manager.capture(progress=False)
    manager.release()
    warmed: list[object] = []
    real = _recording.warm_up

    def counted(graph: object, *args: object) -> None:
        warmed.append(graph)
        real(graph, *args)  # type: ignore[arg-type]  # the planned graph and the rest, passed through

    monkeypatch.setattr(_estimate, "warm_up", counted)
    with torch.no_grad():
        manager.estimate_memory()
    assert len(warmed) == len({id(graph) for graph in warmed}) == 2  # each mode's smallest, once


# -- the predicted rule: two probes a mode, the rest played on their pool -------------------------


def _use(small: int, large: int, small_kept: int = 0, large_kept: int = 0) -> PoolUse:
    return PoolUse(small * MIB, large * MIB, small_kept * MIB, large_kept * MIB)


def test_keys_that_fit_in_what_the_larger_ones_left_grow_nothing() -> None:
    """A decoder's smaller keys: transients shrink faster than their kept outputs add up."""
    probes = [(512, _use(32, 60, small_kept=1)), (504, _use(0, 0, small_kept=1))]
    assert predict_pool(probes, [256, 64, 8, 1]) == 0


def test_kept_outputs_past_the_room_grow_the_pool_in_whole_segments() -> None:
    """Outputs of small blocks kept by every key, more than the first probe's transients left."""
    probes = [(100, _use(2, 0, small_kept=1))]  # 1 MiB of transient room, 1 MiB kept per 100 tokens
    grown = predict_pool(probes, [100, 100, 100])
    assert grown % (2 * MIB) == 0
    assert grown >= 2 * MIB  # three more MiB kept than the first segment's room
    assert predict_pool(probes, []) == 0
    assert predict_pool([], [100]) == 0


def test_a_large_transient_that_does_not_fit_takes_a_large_segment() -> None:
    """A large-block transient above the room left: one of torch's 20 MiB buffers (below 10 MiB asked)."""
    probes = [(100, _use(0, 4, large_kept=2))]  # 2 MiB of transients, 2 MiB kept per 100 tokens
    assert predict_pool(probes, [100]) == 0  # it fits what the probe left: 2 MiB kept, 2 MiB of room
    assert predict_pool(probes, [100, 100]) == 20 * MIB


def test_the_later_probes_bound_the_transients() -> None:
    """A second probe that fit without growing shows the transients are at most the room it found."""
    loose = [(100, _use(20, 0, small_kept=1))]
    tight = [*loose, (99, _use(0, 0, small_kept=1))]
    assert predict_pool(tight, [98, 97]) <= predict_pool(loose, [99, 98, 97])


@given(
    st.lists(
        st.tuples(st.integers(0, 64), st.integers(0, 64), st.integers(0, 8), st.integers(0, 8)), max_size=3
    ),
    st.lists(st.integers(1, 512), max_size=40),
)
def test_the_prediction_never_shrinks_the_pool_and_grows_with_more_keys(
    uses: list[tuple[int, int, int, int]], tokens: list[int]
) -> None:
    probes = [(512 - i, _use(*use)) for i, use in enumerate(uses)]
    grown = predict_pool(probes, sorted(tokens, reverse=True))
    assert grown >= 0
    assert grown % (2 * MIB) == 0
    assert predict_pool(probes, sorted([*tokens, 1], reverse=True)) >= grown
