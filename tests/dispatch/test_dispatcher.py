"""CUDAGraphDispatcher: the keys (docs/design.md, "Keys"), dispatch against a naive model, the capture plan.

The dispatchers drawn here have capture sizes up to 2**20: building one costs
per size, not per token count, so the property tests need no special deadline.
"""

from __future__ import annotations

import re
from typing import Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    Dispatch,
    DispatchConfig,
    EagerReason,
    RankRequest,
    agree_across_ranks,
)
from cudagraph_dispatch._protocols import GraphDispatcher
from tests.dispatch.peak_memory import built_with_peak
from tests.strategies import (
    active_lora_counts,
    dispatch_configs,
    dispatchers,
    dispatchers_with_step_requests,
    dispatchers_with_token_counts,
    invalid_mode_sets,
    step_count,
    step_loras,
)

M: Final = CUDAGraphMode
# Written from docs/design.md ("Modes") rather than through the enum's own methods, so a wrong
# mixed_mode()/decode_mode() cannot hide a wrong key set.
MIXED: Final = {
    M.NONE: M.NONE,
    M.PIECEWISE: M.PIECEWISE,
    M.FULL: M.FULL,
    M.FULL_DECODE_ONLY: M.NONE,
    M.FULL_AND_PIECEWISE: M.PIECEWISE,
}
HAS_UNIFORM_KEYS: Final = frozenset({M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE})


def _lora_cases(config: DispatchConfig) -> list[int]:
    return sorted({0, *config.lora_counts})


def _decode_sizes(config: DispatchConfig) -> list[int]:
    """Sizes with a uniform decode graph: multiples of q in [q, q * max_num_seqs]."""
    if config.mode not in HAS_UNIFORM_KEYS:
        return []
    q = config.uniform_decode_query_len
    return [s for s in config.capture_sizes.sizes if s % q == 0 and q <= s <= q * config.max_num_seqs]


def spec_keys(config: DispatchConfig) -> dict[CUDAGraphMode, set[BatchDescriptor]]:
    """The keys docs/design.md ("Keys") asks for, built the obvious way."""
    keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {M.NONE: set(), M.PIECEWISE: set(), M.FULL: set()}
    mixed = MIXED[config.mode]
    for size in config.capture_sizes.sizes:
        for loras in _lora_cases(config):
            if mixed is M.PIECEWISE:
                keys[M.PIECEWISE].add(BatchDescriptor(size, has_lora=loras > 0, num_active_loras=loras))
            elif mixed is M.FULL:
                reqs = min(size, config.max_num_seqs)
                keys[M.FULL].add(BatchDescriptor(size, reqs, has_lora=loras > 0, num_active_loras=loras))
    q = config.uniform_decode_query_len
    for size in _decode_sizes(config):
        for loras in _lora_cases(config):
            keys[M.FULL].add(BatchDescriptor(size, size // q, True, loras > 0, loras))
    return keys


def spec_dispatch(
    config: DispatchConfig,
    num_tokens: int,
    uniform_decode: bool,
    num_active_loras: int,
    invalid_modes: frozenset[CUDAGraphMode],
) -> Dispatch:
    """The dispatch rules (docs/design.md, "Dispatch"), by linear scans over the spec's key set."""
    eager = Dispatch(M.NONE, BatchDescriptor(num_tokens))
    sizes = config.capture_sizes.sizes
    if config.mode is M.NONE or num_tokens == 0 or num_tokens > max(sizes):
        return eager
    lora_case = next((c for c in _lora_cases(config) if c >= num_active_loras), None)
    if lora_case is None:
        return eager
    keys = spec_keys(config)
    full = set() if M.FULL in invalid_modes else keys[M.FULL]
    piecewise = set() if M.PIECEWISE in invalid_modes else keys[M.PIECEWISE]
    if uniform_decode and M.FULL not in invalid_modes:
        decode = [s for s in _decode_sizes(config) if s >= num_tokens]
        if decode:
            q = config.uniform_decode_query_len
            key = BatchDescriptor(decode[0], decode[0] // q, True, lora_case > 0, lora_case)
            assert key in full
            return Dispatch(M.FULL, key)
    padded = min(s for s in sizes if s >= num_tokens)
    exact = BatchDescriptor(padded, min(padded, config.max_num_seqs), False, lora_case > 0, lora_case)
    if exact in full:
        return Dispatch(M.FULL, exact)
    relaxed = BatchDescriptor(padded, has_lora=lora_case > 0, num_active_loras=lora_case)
    if relaxed in piecewise:
        return Dispatch(M.PIECEWISE, relaxed)
    return eager


# -- keys --


@given(dispatch_configs)
def test_keys_follow_the_design(config: DispatchConfig) -> None:
    """keys(mode) is exactly the key set of docs/design.md ("Keys") for each runtime mode (NONE has none)."""
    dispatcher = CUDAGraphDispatcher(config)
    expected = spec_keys(config)
    for mode in (M.NONE, M.PIECEWISE, M.FULL):
        assert dispatcher.keys(mode) == expected[mode]


@given(dispatchers)
def test_keys_of_a_mode_have_one_shape(dispatcher: CUDAGraphDispatcher) -> None:
    """PIECEWISE keys are relaxed; FULL keys are exact (num_reqs set, never above num_tokens)."""
    for key in dispatcher.keys(M.PIECEWISE):
        assert key == key.relaxed()
    for key in dispatcher.keys(M.FULL):
        assert key.num_reqs is not None
        assert 1 <= key.num_reqs <= key.num_tokens
        assert key.has_lora is (key.num_active_loras > 0)


def test_lora_count_order_does_not_matter() -> None:
    """The LoRA counts are a set: the order a caller lists them in changes no key."""
    sizes = CaptureSizes([1, 4, 16])
    a = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, sizes, 8, lora_counts=(4, 1, 2)))
    b = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, sizes, 8, lora_counts=(1, 2, 4)))
    for mode in (M.PIECEWISE, M.FULL):
        assert a.keys(mode) == b.keys(mode)
        assert {k.num_active_loras for k in a.keys(mode)} == {0, 1, 2, 4}


# -- dispatch --


@pytest.mark.parametrize(("num_tokens", "padded"), [(5, 8), (9, 16), (16, 16)])
def test_full_keys_cap_num_reqs_at_max_num_seqs(num_tokens: int, padded: int) -> None:
    """A FULL graph above max_num_seqs tokens is keyed with max_num_seqs requests, and dispatch finds it."""
    dispatcher = CUDAGraphDispatcher(DispatchConfig(M.FULL, CaptureSizes([1, 8, 16]), max_num_seqs=8))
    expected = Dispatch(M.FULL, BatchDescriptor(padded, num_reqs=min(padded, 8)))
    assert dispatcher.dispatch(num_tokens) == expected
    if num_tokens <= 8:  # a uniform batch of num_tokens requests
        assert dispatcher.dispatch(num_tokens, uniform_decode=True) == expected  # FULL: no separate routine
    else:  # more requests than max_num_seqs: a scheduler's bug, refused (issue 39), not the 8-request graph
        with pytest.raises(
            ValueError, match=rf"^num_tokens: .* {num_tokens} requests .*above max_num_seqs=8$"
        ):
            dispatcher.dispatch(num_tokens, uniform_decode=True)


def test_uniform_keys_stop_at_q_times_max_num_seqs() -> None:
    """With q=2 and 4 sequences, decode graphs exist for 2, 4, 8 (<= 2 * 4) and not for 16 or odd sizes."""
    sizes = CaptureSizes([1, 2, 3, 4, 8, 16])
    dispatcher = CUDAGraphDispatcher(
        DispatchConfig(M.FULL_DECODE_ONLY, sizes, max_num_seqs=4, uniform_decode_query_len=2)
    )
    assert {k.num_tokens for k in dispatcher.keys(M.FULL)} == {2, 4, 8}
    assert dispatcher.dispatch(6, uniform_decode=True) == Dispatch(
        M.FULL, BatchDescriptor(8, 4, uniform=True)
    )
    assert dispatcher.dispatch(10) == Dispatch(M.NONE, BatchDescriptor(10))  # no mixed graphs
    with pytest.raises(ValueError, match=r"num_tokens: .* 5 requests .*above max_num_seqs=4"):  # 10 / q
        dispatcher.dispatch(10, uniform_decode=True)
    with pytest.raises(ValueError, match=r"num_tokens: .* got 3"):  # a uniform batch has a multiple of q
        dispatcher.dispatch(3, uniform_decode=True)


@given(
    dispatchers_with_token_counts(),
    st.booleans(),
    active_lora_counts,
    invalid_mode_sets,
)
def test_dispatch_matches_the_spec_model(
    case: tuple[CUDAGraphDispatcher, int],
    uniform_decode: bool,
    num_active_loras: int,
    invalid_modes: frozenset[CUDAGraphMode],
) -> None:
    """The table-driven dispatch gives the same decision as the spec's rules applied by linear scans."""
    dispatcher, n = case
    n = step_count(dispatcher.config, n, uniform_decode)
    num_active_loras = step_loras(dispatcher.config, n, uniform_decode, num_active_loras)
    got = dispatcher.dispatch(
        n, uniform_decode=uniform_decode, num_active_loras=num_active_loras, invalid_modes=invalid_modes
    )
    assert got == spec_dispatch(dispatcher.config, n, uniform_decode, num_active_loras, invalid_modes)


@given(dispatchers_with_token_counts(), st.booleans(), active_lora_counts, invalid_mode_sets)
def test_dispatch_properties(
    case: tuple[CUDAGraphDispatcher, int],
    uniform_decode: bool,
    num_active_loras: int,
    invalid_modes: frozenset[CUDAGraphMode],
) -> None:
    """A graph decision names a captured key, never an invalid mode, and never pads below the batch."""
    dispatcher, n = case
    n = step_count(dispatcher.config, n, uniform_decode)
    num_active_loras = step_loras(dispatcher.config, n, uniform_decode, num_active_loras)
    mode, key = dispatcher.dispatch(
        n, uniform_decode=uniform_decode, num_active_loras=num_active_loras, invalid_modes=invalid_modes
    )
    assert mode.is_runtime_mode()
    assert mode not in invalid_modes
    if mode is M.NONE:
        assert key == BatchDescriptor(n)
        return
    assert key in dispatcher.keys(mode)
    assert any(mode is m and key in keys for m, keys in dispatcher.capture_plan())
    assert key.num_tokens >= n
    assert key.num_active_loras >= num_active_loras
    assert key.uniform <= uniform_decode  # a uniform graph only for a uniform batch
    if key.uniform:
        assert key.num_reqs is not None
        assert key.num_reqs * dispatcher.config.uniform_decode_query_len == key.num_tokens


@given(dispatchers_with_token_counts(), st.booleans(), active_lora_counts)
def test_padding_is_to_the_smallest_captured_size(
    case: tuple[CUDAGraphDispatcher, int], uniform_decode: bool, num_active_loras: int
) -> None:
    """A non-uniform graph decision pads to exactly capture_sizes.pad(n), not to any larger size."""
    dispatcher, n = case
    n = step_count(dispatcher.config, n, uniform_decode)
    num_active_loras = step_loras(dispatcher.config, n, uniform_decode, num_active_loras)
    mode, key = dispatcher.dispatch(n, uniform_decode=uniform_decode, num_active_loras=num_active_loras)
    if mode is not M.NONE and not key.uniform:
        assert key.num_tokens == dispatcher.config.capture_sizes.pad(n)


@given(dispatchers, st.integers(min_value=1, max_value=64), st.booleans())
def test_above_the_largest_size_runs_eagerly(
    dispatcher: CUDAGraphDispatcher, excess: int, uniform_decode: bool
) -> None:
    """A batch above the largest captured size has no graph: NONE with the real, unpadded count.

    A uniform decode batch of more than ``max_num_seqs`` requests is refused instead, whatever its size.
    """
    config = dispatcher.config
    q = config.uniform_decode_query_len
    n = config.capture_sizes.max + excess
    n = -(-n // q) * q if uniform_decode else n  # every request of a uniform batch has q tokens
    if uniform_decode and n > q * config.max_num_seqs:
        with pytest.raises(ValueError, match=rf"^num_tokens: .*above max_num_seqs={config.max_num_seqs}$"):
            dispatcher.dispatch(n, uniform_decode=True)
        return
    assert dispatcher.dispatch(n, uniform_decode=uniform_decode) == Dispatch(M.NONE, BatchDescriptor(n))


@given(dispatchers_with_token_counts(), st.booleans(), st.integers(min_value=1, max_value=10))
def test_a_step_no_scheduler_makes_is_refused(
    case: tuple[CUDAGraphDispatcher, int], uniform_decode: bool, excess: int
) -> None:
    """More adapters than the step's requests, or a uniform batch above ``max_num_seqs``: ``ValueError``.

    Every request has a token and runs one adapter, and no step has more than
    ``max_num_seqs`` requests; a step that breaks this is an engine's bug, so
    ``dispatch``, ``route`` and ``explain`` name it rather than pick a graph (issue 39).
    """
    dispatcher, n = case
    config = dispatcher.config
    n = step_count(config, n, uniform_decode)
    most = step_loras(config, n, uniform_decode, 2**20)  # the most adapters the step can have
    for method in (dispatcher.dispatch, dispatcher.explain):
        with pytest.raises(ValueError, match=rf"^num_active_loras: {most + excess} active adapters"):
            method(n, uniform_decode=uniform_decode, num_active_loras=most + excess)
    with pytest.raises(ValueError, match=rf"^num_active_loras: {most + excess} active adapters"):
        dispatcher.route(n, uniform_decode, most + excess)
    q = config.uniform_decode_query_len
    too_many = q * (config.max_num_seqs + excess)
    with pytest.raises(ValueError, match=rf"^num_tokens: .* {too_many // q} requests .*max_num_seqs"):
        dispatcher.route(too_many, True)
    if q > 1 and config.max_num_seqs > 1:  # one request of q tokens: 2 adapters fit its tokens, not it
        with pytest.raises(
            ValueError, match=r"^num_active_loras: 2 active adapters for a uniform decode batch"
        ):
            dispatcher.route(q, True, 2)


@given(dispatchers, st.booleans(), invalid_mode_sets)
def test_zero_tokens_run_eagerly(
    dispatcher: CUDAGraphDispatcher, uniform_decode: bool, invalid_modes: frozenset[CUDAGraphMode]
) -> None:
    """An empty batch never replays a graph: NONE with 0 tokens."""
    got = dispatcher.dispatch(0, uniform_decode=uniform_decode, invalid_modes=invalid_modes)
    assert got == Dispatch(M.NONE, BatchDescriptor(0))


@given(dispatchers)
def test_both_graph_modes_invalid_means_eager(dispatcher: CUDAGraphDispatcher) -> None:
    """With PIECEWISE and FULL both turned off, every batch runs eagerly, whatever else was asked."""
    both = frozenset({M.PIECEWISE, M.FULL})
    for n in dispatcher.config.capture_sizes.sizes:
        for uniform in (False, True):
            count = step_count(dispatcher.config, n, uniform)
            assert dispatcher.dispatch(count, uniform_decode=uniform, invalid_modes=both).mode is M.NONE


@given(dispatchers_with_token_counts(), st.lists(invalid_mode_sets, max_size=4))
def test_dispatch_does_not_depend_on_history(
    case: tuple[CUDAGraphDispatcher, int], earlier: list[frozenset[CUDAGraphMode]]
) -> None:
    """Earlier calls, with other invalid_modes, never change a later answer: dispatch keeps no history."""
    dispatcher, n = case
    fresh = CUDAGraphDispatcher(dispatcher.config)
    uniform_n = step_count(dispatcher.config, n, True)
    for invalid in earlier:
        dispatcher.dispatch(uniform_n, invalid_modes=invalid, uniform_decode=True)
    for invalid in [frozenset(), *earlier]:
        for uniform, count in ((False, n), (True, uniform_n)):
            assert dispatcher.dispatch(
                count, uniform_decode=uniform, invalid_modes=invalid
            ) == fresh.dispatch(count, uniform_decode=uniform, invalid_modes=invalid)


@given(dispatchers_with_token_counts(), active_lora_counts)
def test_lora_pads_to_the_smallest_captured_count(
    case: tuple[CUDAGraphDispatcher, int], num_active_loras: int
) -> None:
    """LoRA: the key carries the smallest captured count >= the active one; none large enough -> NONE."""
    dispatcher, n = case
    num_active_loras = step_loras(dispatcher.config, n, False, num_active_loras)
    mode, key = dispatcher.dispatch(n, num_active_loras=num_active_loras)
    captured = [c for c in (0, *dispatcher.config.lora_counts) if c >= num_active_loras]
    if not captured:
        assert mode is M.NONE
    elif mode is not M.NONE:
        assert key.num_active_loras == min(captured)
        assert key.has_lora is (min(captured) > 0)


def test_huge_lora_counts_cost_nothing_extra() -> None:
    """Capturing 10**6 adapters is one LoRA case: counts up to it pad to it, those above run eagerly.

    (A count is at most max_num_seqs, and a step's at most its tokens: a request runs one adapter.)
    """
    huge = 10**6 - 1
    config = DispatchConfig(M.PIECEWISE, CaptureSizes([1, 8, 2**20]), 10**6, lora_counts=(huge,))
    dispatcher, peak = built_with_peak(lambda: CUDAGraphDispatcher(config))
    assert peak < 1024 * 1024, peak  # an entry per adapter count would be 8 MB of pointers alone
    padded = BatchDescriptor(8, has_lora=True, num_active_loras=huge)  # a capacity: above its 8 tokens
    assert dispatcher.dispatch(5, num_active_loras=1) == Dispatch(M.PIECEWISE, padded)
    assert dispatcher.dispatch(5, num_active_loras=5) == Dispatch(M.PIECEWISE, padded)
    largest = BatchDescriptor(2**20, has_lora=True, num_active_loras=huge)
    assert dispatcher.dispatch(10**6, num_active_loras=huge) == Dispatch(M.PIECEWISE, largest)
    assert dispatcher.dispatch(10**6, num_active_loras=10**6) == Dispatch(M.NONE, BatchDescriptor(10**6))


@pytest.mark.parametrize(
    ("sizes", "lora_counts", "far_count"),
    [
        (CaptureSizes([1, 2**20]), (), 2**20 - 1),
        (CaptureSizes.default(32768), (1, 2, 4, 8), 32767),
    ],
    ids=["two-sizes-up-to-2**20", "default-32768-with-lora"],
)
def test_tables_grow_with_the_number_of_sizes(
    sizes: CaptureSizes, lora_counts: tuple[int, ...], far_count: int
) -> None:
    """Building takes memory per capture size, not per token count (that would be 1 GB for [1, 10**6])."""
    config = DispatchConfig(M.FULL_AND_PIECEWISE, sizes, max_num_seqs=1024, lora_counts=lora_counts)
    dispatcher, peak = built_with_peak(lambda: CUDAGraphDispatcher(config))
    assert peak < 10 * 1024 * 1024, peak
    # Still right at the far end, and for the largest LoRA case.
    loras = max(lora_counts, default=0)
    expected = BatchDescriptor(sizes.max, has_lora=loras > 0, num_active_loras=loras)
    assert dispatcher.dispatch(far_count, num_active_loras=loras) == Dispatch(M.PIECEWISE, expected)
    assert dispatcher.dispatch(sizes.max + 1) == Dispatch(M.NONE, BatchDescriptor(sizes.max + 1))


class _Count(int):
    """An int subclass, as some engines pass (an IntEnum, a counter type)."""


def test_int_subclasses_dispatch_as_plain_ints() -> None:
    """An int subclass is a valid count: it takes the checked path and dispatches like the plain int."""
    dispatcher = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([1, 8]), 8))
    for n in (0, 3, 8, 9):
        got = dispatcher.dispatch(_Count(n), num_active_loras=_Count(0), uniform_decode=n % 2 == 0)
        assert got == dispatcher.dispatch(n, uniform_decode=n % 2 == 0)
        assert got.descriptor.num_tokens.__class__ is int


@pytest.mark.parametrize(
    ("num_tokens", "num_active_loras", "field", "value"),
    [
        (-1, 0, "num_tokens", "-1"),
        (-512, 0, "num_tokens", "-512"),
        (4, -1, "num_active_loras", "-1"),
    ],
)
def test_negative_counts_are_rejected(num_tokens: int, num_active_loras: int, field: str, value: str) -> None:
    """A negative count is a caller bug: ValueError naming the argument and the value."""
    dispatcher = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([1, 8]), 8))
    with pytest.raises(ValueError, match=f"{re.escape(field)}.*{re.escape(value)}"):
        dispatcher.dispatch(num_tokens, num_active_loras=num_active_loras)


# -- capture plan --


@given(dispatchers)
def test_capture_plan_order_and_content(dispatcher: CUDAGraphDispatcher) -> None:
    """PIECEWISE group then FULL, each largest first, no empty group, and together exactly keys()."""
    plan = dispatcher.capture_plan()
    order = [mode for mode, _ in plan]
    assert order in ([], [M.PIECEWISE], [M.FULL], [M.PIECEWISE, M.FULL])
    for mode, keys in plan:
        assert keys, f"empty {mode.name} group"
        assert len(set(keys)) == len(keys)
        assert set(keys) == dispatcher.keys(mode)
        sizes = [k.num_tokens for k in keys]
        assert sizes == sorted(sizes, reverse=True)
    planned = {(mode, k) for mode, keys in plan for k in keys}
    existing = {(mode, k) for mode in (M.PIECEWISE, M.FULL) for k in dispatcher.keys(mode)}
    assert planned == existing


@given(dispatch_configs)
def test_capture_plan_is_empty_exactly_when_there_are_no_keys(config: DispatchConfig) -> None:
    """Mode NONE captures nothing; every other mode captures at least one group."""
    plan = CUDAGraphDispatcher(config).capture_plan()
    assert (plan == []) is (not any(spec_keys(config).values()))


class _EagerOnlyDispatcher:
    """A stand-in ``GraphDispatcher`` with no graphs: every batch runs eagerly. Records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, int, frozenset[CUDAGraphMode]]] = []

    def dispatch(
        self,
        num_tokens: int,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = frozenset(),
    ) -> Dispatch:
        self.calls.append((num_tokens, uniform_decode, num_active_loras, invalid_modes))
        return Dispatch(M.NONE, BatchDescriptor(num_tokens))


def test_agree_across_ranks_asks_the_dispatcher_it_is_given() -> None:
    """``agree_across_ranks`` calls ``dispatch`` alone (``GraphDispatcher``): a stand-in's answers rule."""
    concrete = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([1, 2, 4]), 4))
    typed: GraphDispatcher = concrete  # mypy checks that CUDAGraphDispatcher is a GraphDispatcher
    requests = [RankRequest(3, uniform_decode=True), RankRequest(0)]
    # Written from docs/design.md ("Ranks"): the idle rank follows; 3 uniform tokens pad to the 4-token key.
    assert agree_across_ranks(typed, requests) == Dispatch(M.FULL, BatchDescriptor(4, 4, uniform=True))
    fake = _EagerOnlyDispatcher()
    stand_in: GraphDispatcher = fake  # and that the stand-in is one too
    assert agree_across_ranks(stand_in, requests) == Dispatch(M.NONE, BatchDescriptor(3))
    assert fake.calls == [(3, True, 0, frozenset())]  # the rank with tokens, asked once; then all eager


@given(dispatchers_with_token_counts(), st.booleans(), active_lora_counts, invalid_mode_sets)
def test_route_is_dispatch_with_the_reason_beside_it(
    case: tuple[CUDAGraphDispatcher, int],
    uniform_decode: bool,
    num_active_loras: int,
    invalid_modes: frozenset[CUDAGraphMode],
) -> None:
    """``route`` gives dispatch's graph, or the reason the batch has none, derived here from the rules."""
    dispatcher, n = case
    n = step_count(dispatcher.config, n, uniform_decode)
    num_active_loras = step_loras(dispatcher.config, n, uniform_decode, num_active_loras)
    decision = dispatcher.dispatch(
        n, uniform_decode=uniform_decode, num_active_loras=num_active_loras, invalid_modes=invalid_modes
    )
    route = dispatcher.route(
        n, uniform_decode=uniform_decode, num_active_loras=num_active_loras, invalid_modes=invalid_modes
    )
    config = dispatcher.config
    if decision.mode is not M.NONE:
        assert route == decision  # a graph
        return
    if n == 0:
        expected = EagerReason.EMPTY_BATCH  # in every mode, NONE included
    elif config.mode is not M.NONE and n > config.capture_sizes.max:
        expected = EagerReason.ABOVE_LARGEST_SIZE
    elif config.mode is not M.NONE and num_active_loras > max(config.lora_counts, default=0):
        expected = EagerReason.LORA_COUNT
    elif (
        invalid_modes
        and dispatcher.dispatch(n, uniform_decode=uniform_decode, num_active_loras=num_active_loras).mode
        is not M.NONE
    ):
        expected = EagerReason.INVALID_MODES  # a graph that only the step's invalid_modes turned off
    else:
        expected = EagerReason.NO_GRAPH_FOR_BATCH
    assert route is expected


@pytest.mark.parametrize("mode", list(CUDAGraphMode))
@pytest.mark.parametrize("uniform_decode", [False, True])
def test_an_empty_batch_is_empty_batch_in_every_mode(mode: CUDAGraphMode, uniform_decode: bool) -> None:
    """0 tokens is an idle step in every mode, NONE included (the rule checks the empty batch first).

    Every mode, deterministically: the property above draws mode NONE with 0
    tokens only sometimes, so the order of the two checks needs its own case.
    """
    dispatcher = CUDAGraphDispatcher(DispatchConfig(mode, CaptureSizes([1, 2, 4]), max_num_seqs=4))
    assert dispatcher.route(0, uniform_decode=uniform_decode) is EagerReason.EMPTY_BATCH
    assert dispatcher.dispatch(0, uniform_decode=uniform_decode) == Dispatch(M.NONE, BatchDescriptor(0))


@given(dispatchers_with_step_requests())
def test_a_route_that_is_a_dispatch_names_a_graph(case: tuple[CUDAGraphDispatcher, RankRequest]) -> None:
    """Every ``route`` that is a ``Dispatch`` has a graph: FULL or PIECEWISE, one of the keys (issue 33).

    So ``isinstance(route, Dispatch)`` means "replay"; a batch without a graph,
    the empty one included, routes to its ``EagerReason``.
    """
    dispatcher, request = case
    route = dispatcher.route(
        request.num_tokens, request.uniform_decode, request.num_active_loras, request.invalid_modes
    )
    if isinstance(route, Dispatch):
        assert route.mode in (M.FULL, M.PIECEWISE), route
        assert route.descriptor in dispatcher.keys(route.mode)
    else:
        assert isinstance(route, EagerReason)
