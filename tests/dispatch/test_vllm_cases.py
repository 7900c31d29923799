"""vLLM's own dispatcher cases (tests/v1/cudagraph/test_cudagraph_dispatch.py), on this API.

vLLM builds its dispatcher from capture sizes [1, 8] and max_num_seqs=8 and
checks, per mode: how many keys each runtime mode has, and what a non-uniform
batch, a uniform decode batch, an uncaptured size and a cascade-attention
batch (FULL turned off) dispatch to; a LoRA variant captures counts
[0, 1, 2, 4, 5] (max_loras=4, specialised: powers of two and max_loras + 1).
Expected values are written from the rules of docs/design.md ("Dispatch"), as vLLM's test writes them.
"""

from __future__ import annotations

from typing import Final

import pytest

from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    Dispatch,
    DispatchConfig,
)

M: Final = CUDAGraphMode
ALL_MODES: Final = list(CUDAGraphMode)
VLLM_LORA_COUNTS: Final = (1, 2, 4, 5)  # besides 0: get_captured_lora_counts(4, specialize=True)

# (PIECEWISE keys, FULL keys) per mode with sizes [1, 8] and no LoRA, as in vLLM's test.
KEY_COUNTS: Final = {
    M.NONE: (0, 0),
    M.PIECEWISE: (2, 0),
    M.FULL: (0, 2),
    M.FULL_DECODE_ONLY: (0, 2),
    M.FULL_AND_PIECEWISE: (2, 2),
}

EXACT_8: Final = BatchDescriptor(8, num_reqs=8)  # FULL mixed key: num_reqs = min(8, max_num_seqs)
UNIFORM_8: Final = BatchDescriptor(8, num_reqs=8, uniform=True)  # FULL decode key: 8 requests of 1 token
RELAXED_8: Final = BatchDescriptor(8)  # PIECEWISE key
EAGER_8: Final = Dispatch(M.NONE, BatchDescriptor(8))


def _dispatcher(mode: CUDAGraphMode, lora_counts: tuple[int, ...] = ()) -> CUDAGraphDispatcher:
    return CUDAGraphDispatcher(
        DispatchConfig(mode, CaptureSizes([1, 8]), max_num_seqs=8, lora_counts=lora_counts)
    )


@pytest.mark.parametrize("mode", ALL_MODES)
def test_key_counts(mode: CUDAGraphMode) -> None:
    """Each mode captures 2 graphs (sizes 1 and 8) in the runtime modes it uses, none elsewhere."""
    dispatcher = _dispatcher(mode)
    assert (len(dispatcher.keys(M.PIECEWISE)), len(dispatcher.keys(M.FULL))) == KEY_COUNTS[mode]
    assert dispatcher.keys(M.NONE) == frozenset()


@pytest.mark.parametrize("mode", ALL_MODES)
def test_key_counts_with_lora(mode: CUDAGraphMode) -> None:
    """With LoRA cases [0, 1, 2, 4, 5] every graph exists once per case: 2 sizes x 5 = 10 keys."""
    dispatcher = _dispatcher(mode, VLLM_LORA_COUNTS)
    piecewise, full = KEY_COUNTS[mode]
    assert (len(dispatcher.keys(M.PIECEWISE)), len(dispatcher.keys(M.FULL))) == (piecewise * 5, full * 5)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (M.NONE, EAGER_8),
        (M.PIECEWISE, Dispatch(M.PIECEWISE, RELAXED_8)),
        (M.FULL, Dispatch(M.FULL, EXACT_8)),
        (M.FULL_DECODE_ONLY, EAGER_8),  # mixed batches run eagerly
        (M.FULL_AND_PIECEWISE, Dispatch(M.PIECEWISE, RELAXED_8)),
    ],
)
def test_non_uniform_batch(mode: CUDAGraphMode, expected: Dispatch) -> None:
    """Case 1: a mixed batch of a captured size gets the mixed mode's key (exact FULL, relaxed PIECEWISE)."""
    assert _dispatcher(mode).dispatch(8, uniform_decode=False) == expected


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (M.NONE, EAGER_8),
        (M.PIECEWISE, Dispatch(M.PIECEWISE, RELAXED_8)),
        (M.FULL, Dispatch(M.FULL, EXACT_8)),  # no separate routine: the non-uniform FULL graph
        (M.FULL_DECODE_ONLY, Dispatch(M.FULL, UNIFORM_8)),
        (M.FULL_AND_PIECEWISE, Dispatch(M.FULL, UNIFORM_8)),
    ],
)
def test_uniform_decode_batch(mode: CUDAGraphMode, expected: Dispatch) -> None:
    """Case 2: a uniform decode batch takes the uniform FULL graph where the mode has one."""
    assert _dispatcher(mode).dispatch(8, uniform_decode=True) == expected


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("uniform_decode", [False, True])
def test_oversized_batch_runs_eagerly(mode: CUDAGraphMode, uniform_decode: bool) -> None:
    """Case 3: 15 tokens exceed the largest size (8): NONE, with the real count.

    A uniform decode batch of 15 tokens is 15 requests, so it is asked of a
    config with max_num_seqs=16: with vLLM's 8, no scheduler makes one, and the
    dispatcher refuses it (``test_uniform_batch_above_max_num_seqs_is_refused``).
    """
    dispatcher = CUDAGraphDispatcher(DispatchConfig(mode, CaptureSizes([1, 8]), max_num_seqs=16))
    got = dispatcher.dispatch(15, uniform_decode=uniform_decode)
    assert got == Dispatch(M.NONE, BatchDescriptor(15))


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("num_tokens", [9, 15])
def test_uniform_batch_above_max_num_seqs_is_refused(mode: CUDAGraphMode, num_tokens: int) -> None:
    """A uniform decode batch of more than max_num_seqs=8 requests is a scheduler's bug: ``ValueError``.

    Before issue 39 it was dispatched without a word: here eagerly (above the
    largest size); with larger sizes, to a mixed graph (PIECEWISE, or a FULL
    key of 8 requests).
    """
    with pytest.raises(
        ValueError, match=rf"^num_tokens: .* is {num_tokens} requests .*above max_num_seqs=8$"
    ):
        _dispatcher(mode).dispatch(num_tokens, uniform_decode=True)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (M.NONE, EAGER_8),
        (M.PIECEWISE, Dispatch(M.PIECEWISE, RELAXED_8)),
        (M.FULL, EAGER_8),
        (M.FULL_DECODE_ONLY, EAGER_8),
        (M.FULL_AND_PIECEWISE, Dispatch(M.PIECEWISE, RELAXED_8)),
    ],
)
@pytest.mark.parametrize("uniform_decode", [False, True])
def test_cascade_attention_turns_full_off(
    mode: CUDAGraphMode, expected: Dispatch, uniform_decode: bool
) -> None:
    """Case 4: with FULL invalid (cascade attention), modes with PIECEWISE fall back to it, others to NONE."""
    got = _dispatcher(mode).dispatch(8, uniform_decode=uniform_decode, invalid_modes=frozenset({M.FULL}))
    assert got == expected


@pytest.mark.parametrize("mode", ALL_MODES)
def test_all_graph_modes_invalid(mode: CUDAGraphMode) -> None:
    """Case 5 (vLLM's valid_modes={NONE}): with every graph mode off, NONE even though keys exist."""
    got = _dispatcher(mode).dispatch(8, invalid_modes=frozenset({M.PIECEWISE, M.FULL}))
    assert got == EAGER_8


@pytest.mark.parametrize(
    ("mode", "expected_mode"),
    [(M.PIECEWISE, M.PIECEWISE), (M.FULL, M.FULL), (M.FULL_AND_PIECEWISE, M.PIECEWISE)],
)
def test_uncaptured_size_pads_up(mode: CUDAGraphMode, expected_mode: CUDAGraphMode) -> None:
    """5 tokens, between sizes 1 and 8, run the size-8 graph of the mixed mode."""
    mode_got, key = _dispatcher(mode).dispatch(5)
    assert mode_got is expected_mode
    assert key.num_tokens == 8


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (M.NONE, Dispatch(M.NONE, BatchDescriptor(8))),
        (M.PIECEWISE, Dispatch(M.PIECEWISE, BatchDescriptor(8, has_lora=True, num_active_loras=4))),
        (M.FULL, Dispatch(M.FULL, BatchDescriptor(8, 8, has_lora=True, num_active_loras=4))),
        (M.FULL_DECODE_ONLY, Dispatch(M.NONE, BatchDescriptor(8))),
        (M.FULL_AND_PIECEWISE, Dispatch(M.PIECEWISE, BatchDescriptor(8, has_lora=True, num_active_loras=4))),
    ],
)
def test_lora_batch(mode: CUDAGraphMode, expected: Dispatch) -> None:
    """A mixed batch with 3 active adapters runs the graph captured for 4 (smallest count >= 3)."""
    assert _dispatcher(mode, VLLM_LORA_COUNTS).dispatch(8, num_active_loras=3) == expected


@pytest.mark.parametrize("mode", [M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
def test_lora_uniform_decode(mode: CUDAGraphMode) -> None:
    """A uniform decode batch with 5 adapters runs the uniform FULL graph captured for 5."""
    got = _dispatcher(mode, VLLM_LORA_COUNTS).dispatch(8, uniform_decode=True, num_active_loras=5)
    assert got == Dispatch(M.FULL, BatchDescriptor(8, 8, uniform=True, has_lora=True, num_active_loras=5))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_too_many_adapters_run_eagerly(mode: CUDAGraphMode) -> None:
    """6 active adapters exceed every captured count (max 5): no graph holds them, so NONE."""
    got = _dispatcher(mode, VLLM_LORA_COUNTS).dispatch(8, num_active_loras=6)
    assert got == EAGER_8


@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL, M.FULL_AND_PIECEWISE])
def test_lora_without_lora_graphs_runs_eagerly(mode: CUDAGraphMode) -> None:
    """Without captured LoRA counts, a batch with an active adapter has no graph: NONE."""
    assert _dispatcher(mode).dispatch(8, num_active_loras=1) == EAGER_8


@pytest.mark.parametrize(
    ("mode", "expected_modes"),
    [
        (M.NONE, []),
        (M.PIECEWISE, [M.PIECEWISE]),
        (M.FULL, [M.FULL]),
        (M.FULL_DECODE_ONLY, [M.FULL]),
        (M.FULL_AND_PIECEWISE, [M.PIECEWISE, M.FULL]),
    ],
)
def test_capture_plan_groups(mode: CUDAGraphMode, expected_modes: list[CUDAGraphMode]) -> None:
    """vLLM's get_capture_descs case: groups per mode, largest first, one uniformity per group."""
    dispatcher = CUDAGraphDispatcher(DispatchConfig(mode, CaptureSizes([1, 4, 8, 16]), max_num_seqs=16))
    plan = dispatcher.capture_plan()
    assert [group_mode for group_mode, _ in plan] == expected_modes
    for _, keys in plan:
        assert [k.num_tokens for k in keys] == [16, 8, 4, 1]
        assert len({k.uniform for k in keys}) == 1
