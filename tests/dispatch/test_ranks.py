"""agree_across_ranks: one decision for every data-parallel rank, computed locally from all requests."""

from __future__ import annotations

import dataclasses
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
    RankRequest,
    agree_across_ranks,
)
from tests.strategies import (
    dispatchers,
    dispatchers_with_rank_requests,
    invalid_mode_sets,
    separate_routine_dispatchers,
)

M: Final = CUDAGraphMode
Case = tuple[CUDAGraphDispatcher, list[RankRequest]]


def _own(dispatcher: CUDAGraphDispatcher, request: RankRequest) -> Dispatch:
    """What a rank would run on its own."""
    return dispatcher.dispatch(
        request.num_tokens,
        uniform_decode=request.uniform_decode,
        num_active_loras=request.num_active_loras,
    )


@given(dispatchers_with_rank_requests(), st.data())
def test_decision_does_not_depend_on_rank_order(case: Case, data: st.DataObject) -> None:
    """Each rank sees the gathered requests in its own order; all must reach the same decision."""
    dispatcher, requests = case
    shuffled = data.draw(st.permutations(requests), label="shuffled")
    assert agree_across_ranks(dispatcher, shuffled) == agree_across_ranks(dispatcher, requests)


@given(dispatchers_with_rank_requests())
def test_every_rank_is_every_rank_in_turn(case: Case) -> None:
    """Rotating the list (each rank putting itself first) changes nothing: the function is pure."""
    dispatcher, requests = case
    decisions = {agree_across_ranks(dispatcher, requests[i:] + requests[:i]) for i in range(len(requests))}
    assert len(decisions) == 1


@given(dispatchers_with_rank_requests())
def test_no_rank_is_padded_below_its_tokens(case: Case) -> None:
    """The agreed token count holds every rank's batch, graph or eager."""
    dispatcher, requests = case
    mode, key = agree_across_ranks(dispatcher, requests)
    assert all(key.num_tokens >= r.num_tokens for r in requests)
    if mode is not M.NONE:
        assert all(key.num_active_loras >= r.num_active_loras for r in requests if r.num_tokens > 0)


@given(dispatchers_with_rank_requests())
def test_graph_decision_is_a_captured_key(case: Case) -> None:
    """A graph decision is one of the dispatcher's keys, uniform only if every rank with tokens is."""
    dispatcher, requests = case
    mode, key = agree_across_ranks(dispatcher, requests)
    if mode is M.NONE:
        return
    assert key in dispatcher.keys(mode)
    active = [r for r in requests if r.num_tokens > 0]
    if key.uniform:
        assert all(r.uniform_decode for r in active)


@given(dispatchers_with_rank_requests())
def test_graph_decision_is_the_dispatch_of_the_largest_request(case: Case) -> None:
    """When every rank can use a graph, all pad to the dispatch of the largest request (joint flags)."""
    dispatcher, requests = case
    decision = agree_across_ranks(dispatcher, requests)
    if decision.mode is M.NONE:
        return
    active = [r for r in requests if r.num_tokens > 0]
    joint = dispatcher.dispatch(
        max(r.num_tokens for r in active),
        uniform_decode=all(r.uniform_decode for r in active),
        num_active_loras=max(r.num_active_loras for r in active),
    )
    assert decision == joint


@given(dispatchers_with_rank_requests(separate_routine_dispatchers))
def test_uniform_only_if_every_active_rank_is_uniform(case: Case) -> None:
    """Where decode has its own graphs, one mixed rank with tokens moves every rank to the mixed graph."""
    dispatcher, requests = case
    mode, key = agree_across_ranks(dispatcher, requests)
    active = [r for r in requests if r.num_tokens > 0]
    if mode is not M.NONE and not all(r.uniform_decode for r in active):
        assert not key.uniform
        assert key in dispatcher.keys(dispatcher.config.mode.mixed_mode())


@given(dispatchers_with_rank_requests())
def test_one_eager_rank_makes_all_eager(case: Case) -> None:
    """If any rank with tokens would run eagerly, all run eagerly, unpadded (the largest real count)."""
    dispatcher, requests = case
    active = [r for r in requests if r.num_tokens > 0]
    if not any(_own(dispatcher, r).mode is M.NONE for r in active):
        return
    largest = max(r.num_tokens for r in active)
    assert agree_across_ranks(dispatcher, requests) == Dispatch(M.NONE, BatchDescriptor(largest))


@given(dispatchers, st.integers(min_value=1, max_value=8))
def test_all_ranks_idle_is_none_with_zero(dispatcher: CUDAGraphDispatcher, ranks: int) -> None:
    """With no tokens anywhere there is nothing to replay: NONE with 0 tokens."""
    requests = [RankRequest(0, uniform_decode=i % 2 == 0) for i in range(ranks)]
    assert agree_across_ranks(dispatcher, requests) == Dispatch(M.NONE, BatchDescriptor(0))


@given(dispatchers_with_rank_requests(), st.integers(min_value=1, max_value=4), st.booleans())
def test_idle_ranks_follow_the_others(case: Case, idle: int, uniform: bool) -> None:
    """Ranks with 0 tokens (uniform or not) do not change the decision of the ranks with tokens.

    (An idle rank has no adapters: a request runs one and has a token, so
    ``RankRequest`` refuses more adapters than tokens.)
    """
    dispatcher, requests = case
    padded = requests + [RankRequest(0, uniform_decode=uniform)] * idle
    assert agree_across_ranks(dispatcher, padded) == agree_across_ranks(dispatcher, requests)


@given(dispatchers_with_rank_requests())
def test_a_single_rank_dispatches_as_usual(case: Case) -> None:
    """With one rank there is nobody to agree with: the decision is that rank's own dispatch."""
    dispatcher, (request, *_) = case
    assert agree_across_ranks(dispatcher, [request]) == _own(dispatcher, request)


@given(dispatchers_with_rank_requests(), invalid_mode_sets)
def test_invalid_modes_hold_for_all_ranks(case: Case, invalid_modes: frozenset[CUDAGraphMode]) -> None:
    """A mode turned off for the step (e.g. FULL under cascade attention) is never agreed on."""
    dispatcher, requests = case
    decision = agree_across_ranks(dispatcher, requests, invalid_modes=invalid_modes)
    assert decision.mode not in invalid_modes


def test_worked_example() -> None:
    """Decode ranks of 3 and 5 tokens and an idle rank share the uniform size-8 graph; a prefill rank,
    even a small one, makes it the mixed PIECEWISE graph; a rank above the largest makes all eager."""
    dispatcher = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([1, 2, 4, 8, 16]), 8))
    decode = [RankRequest(3, True), RankRequest(0), RankRequest(5, True)]
    assert agree_across_ranks(dispatcher, decode) == Dispatch(M.FULL, BatchDescriptor(8, 8, uniform=True))
    small_prefill = [*decode, RankRequest(2)]
    assert agree_across_ranks(dispatcher, small_prefill) == Dispatch(M.PIECEWISE, BatchDescriptor(8))
    mixed = [*decode, RankRequest(10)]
    assert agree_across_ranks(dispatcher, mixed) == Dispatch(M.PIECEWISE, BatchDescriptor(16))
    too_big = [*mixed, RankRequest(17)]
    assert agree_across_ranks(dispatcher, too_big) == Dispatch(M.NONE, BatchDescriptor(17))


@pytest.mark.parametrize(
    ("num_tokens", "num_active_loras", "field", "value"),
    [
        (-1, 0, "num_tokens", "-1"),
        (4, -2, "num_active_loras", "-2"),
    ],
)
def test_negative_request_counts_are_rejected(
    num_tokens: int, num_active_loras: int, field: str, value: str
) -> None:
    """A rank request with a negative count is a ValueError naming the field and the value."""
    with pytest.raises(ValueError, match=f"{re.escape(field)}.*{re.escape(value)}"):
        RankRequest(num_tokens, num_active_loras=num_active_loras)


def test_no_ranks_is_an_error() -> None:
    """A decision needs at least one rank's request; an empty list is a caller bug."""
    dispatcher = CUDAGraphDispatcher(DispatchConfig(M.FULL, CaptureSizes([1, 8]), 8))
    with pytest.raises(ValueError, match="requests"):
        agree_across_ranks(dispatcher, [])


@given(dispatchers_with_rank_requests(), st.data())
def test_a_mode_one_rank_turns_off_is_off_for_all(case: Case, data: st.DataObject) -> None:
    """A rank's own ``invalid_modes`` counts as the step's: the same decision as passing it for all."""
    dispatcher, requests = case
    rank = data.draw(st.integers(0, len(requests) - 1))
    modes = data.draw(invalid_mode_sets)
    carried = [
        dataclasses.replace(r, invalid_modes=modes) if i == rank else r for i, r in enumerate(requests)
    ]
    assert agree_across_ranks(dispatcher, carried) == agree_across_ranks(
        dispatcher, requests, invalid_modes=modes
    )


def test_one_request_type_for_steps_and_ranks() -> None:
    """``RankRequest`` is ``RankRequest``: the dispatcher, the ranks and an eager step share it."""
    assert RankRequest is RankRequest
    request = RankRequest(5, True, 1, frozenset({M.FULL}))
    assert (request.num_tokens, request.uniform_decode, request.num_active_loras) == (5, True, 1)
    assert request == RankRequest(
        5, uniform_decode=True, num_active_loras=1, invalid_modes=frozenset({M.FULL})
    )
    assert hash(request) == hash(RankRequest(5, True, 1, frozenset({M.FULL})))  # a key


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_tokens": 2.0}, "num_tokens"),
        ({"num_tokens": True}, "num_tokens"),
        ({"num_tokens": 2, "uniform_decode": 1}, "uniform_decode"),
        ({"num_tokens": 2, "num_active_loras": None}, "num_active_loras"),
        ({"num_tokens": 2, "invalid_modes": {M.FULL}}, "invalid_modes"),
        ({"num_tokens": 2, "invalid_modes": frozenset({M.NONE})}, "invalid_modes"),
    ],
)
def test_a_bad_request_names_its_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        RankRequest(**kwargs)  # type: ignore[arg-type]  # bad on purpose


def test_agreement_refuses_a_bad_invalid_modes_and_a_bad_dispatcher() -> None:
    dispatcher = CUDAGraphDispatcher(DispatchConfig(M.FULL, CaptureSizes([1, 8]), 8))
    with pytest.raises(ValueError, match=r"^invalid_modes: "):
        agree_across_ranks(dispatcher, [RankRequest(3)], invalid_modes=[M.FULL])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^dispatcher: "):
        agree_across_ranks(None, [RankRequest(3)])  # type: ignore[arg-type]
