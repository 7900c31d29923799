"""Token budgets and the packing of items into them (docs/design.md, "Encoder graphs").

Properties of ``TokenBudgets.pack`` over any ladder, bound and batch: every
item in exactly one pack; each pack within its budget and its item bound,
padded to the smallest budget holding it; a batch that fits one pack is one
pack (in order); no two packs could be merged (greedy, fewest); the same
batch packs the same way. Errors name the item or the argument.
"""

from __future__ import annotations

from bisect import bisect_left

import pytest
from hypothesis import given

from cudagraph_dispatch import BatchDescriptor, CUDAGraphDispatcher, CUDAGraphMode, Dispatch
from cudagraph_dispatch.budgets import Pack, TokenBudgets
from tests.strategies import budgets_and_lengths, token_budgets


@given(budgets_and_lengths())
def test_every_item_is_in_exactly_one_pack_within_its_budget(case: tuple[TokenBudgets, list[int]]) -> None:
    budgets, lengths = case
    packs = budgets.pack(lengths)
    placed = sorted(i for pack in packs for i in pack.items)
    assert placed == list(range(len(lengths)))
    for pack in packs:
        assert pack.items == tuple(sorted(pack.items))  # concatenated in the caller's order
        assert pack.tokens == sum(lengths[i] for i in pack.items)
        assert 1 <= len(pack.items) <= budgets.max_items
        assert pack.tokens <= pack.budget
        assert pack.padding == pack.budget - pack.tokens


@given(budgets_and_lengths())
def test_each_pack_pads_to_the_smallest_budget_that_holds_it(case: tuple[TokenBudgets, list[int]]) -> None:
    budgets, lengths = case
    for pack in budgets.pack(lengths):
        assert pack.budget == budgets.budgets[bisect_left(budgets.budgets, pack.tokens)]
        assert pack.budget == budgets.budget_for(pack.tokens)


@given(budgets_and_lengths())
def test_a_batch_that_fits_one_pack_is_not_split(case: tuple[TokenBudgets, list[int]]) -> None:
    budgets, lengths = case
    packs = budgets.pack(lengths)
    if lengths and sum(lengths) <= budgets.max and len(lengths) <= budgets.max_items:
        assert packs == (
            Pack(budgets.budget_for(sum(lengths)) or 0, tuple(range(len(lengths))), sum(lengths)),
        )
    elif lengths:
        assert len(packs) > 1  # the split is returned, one pack per forward


@given(budgets_and_lengths())
def test_no_two_packs_could_be_merged(case: tuple[TokenBudgets, list[int]]) -> None:
    """Fewest packs, as greedy first-fit gives: any two together exceed the tokens or the item bound."""
    budgets, lengths = case
    packs = budgets.pack(lengths)
    for a, first in enumerate(packs):
        for second in packs[a + 1 :]:
            fits_tokens = first.tokens + second.tokens <= budgets.max
            fits_items = len(first.items) + len(second.items) <= budgets.max_items
            assert not (fits_tokens and fits_items), (first, second)
    lower_bound = max(-(-sum(lengths) // budgets.max), -(-len(lengths) // budgets.max_items))
    assert len(packs) >= lower_bound
    # At most one pack is at most half full (else those two would merge), where items do not bind.
    if budgets.max_items >= len(lengths):
        assert len(packs) <= max(1, 2 * lower_bound)


@given(budgets_and_lengths())
def test_packing_is_deterministic(case: tuple[TokenBudgets, list[int]]) -> None:
    budgets, lengths = case
    assert budgets.pack(lengths) == budgets.pack(tuple(lengths))


@given(token_budgets)
def test_the_config_keys_one_full_graph_per_budget(budgets: TokenBudgets) -> None:
    config = budgets.config()
    assert config.mode is CUDAGraphMode.FULL
    assert config.capture_sizes.sizes == budgets.budgets
    dispatcher = CUDAGraphDispatcher(config)
    expected = {BatchDescriptor(b, min(b, budgets.max_items)) for b in budgets.budgets}
    assert dispatcher.keys(CUDAGraphMode.FULL) == expected
    assert dispatcher.keys(CUDAGraphMode.PIECEWISE) == frozenset()


@given(budgets_and_lengths())
def test_each_pack_dispatches_to_its_budgets_graph(case: tuple[TokenBudgets, list[int]]) -> None:
    budgets, lengths = case
    dispatcher = CUDAGraphDispatcher(budgets.config())
    for pack in budgets.pack(lengths):
        key = BatchDescriptor(pack.budget, min(pack.budget, budgets.max_items))
        assert dispatcher.route(pack.tokens) == Dispatch(CUDAGraphMode.FULL, key)


def test_the_default_ladder_is_powers_of_two_from_64() -> None:
    assert TokenBudgets.default(8192).budgets == (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert TokenBudgets.default(1000).budgets == (64, 128, 256, 512, 1000)
    assert TokenBudgets.default(40).budgets == (40,)
    assert TokenBudgets.default(8192, max_items=8).max_items == 8
    assert TokenBudgets.default(8192).max_items == 8192  # no bound: every item has a token
    assert TokenBudgets([16, 4], max_items=99).max_items == 16


def test_an_item_above_the_largest_budget_is_an_error_naming_it() -> None:
    budgets = TokenBudgets.default(1024)
    with pytest.raises(
        ValueError, match=r"lengths\[2\]: an item of 1025 tokens exceeds the largest budget 1024"
    ):
        budgets.pack([64, 10, 1025])


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([0], r"lengths\[0\]: expected an integer >= 1, got 0"),
        ([3, True], r"lengths\[1\]: expected an integer >= 1, got True"),
        ([3, 2.0], r"lengths\[1\]"),
        ("12", r"lengths: expected a sequence of integers"),
        (None, r"lengths: expected a sequence of integers"),
    ],
)
def test_bad_lengths_are_named(lengths: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TokenBudgets([64]).pack(lengths)  # type: ignore[arg-type]  # a bad value on purpose


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: TokenBudgets([]), r"^budgets: expected at least one budget, got \[\]"),
        (lambda: TokenBudgets({64: 1}), r"^budgets: expected an iterable of integers .*got \{64: 1\}"),
        (lambda: TokenBudgets([64, 0]), r"budgets\[1\]: expected an integer >= 1, got 0"),
        (lambda: TokenBudgets("64"), r"budgets: expected an iterable of integers"),  # type: ignore[arg-type]  # a bad value on purpose
        (lambda: TokenBudgets([64], max_items=0), r"max_items: expected an integer >= 1, got 0"),
        (lambda: TokenBudgets([64], max_items=True), r"max_items: expected an integer >= 1, got True"),
        (lambda: TokenBudgets.default(0), r"max_budget: expected an integer >= 1, got 0"),
    ],
)
def test_bad_ladders_are_named(call: object, match: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=match):
        call()


def test_budgets_are_values() -> None:
    assert TokenBudgets([128, 64, 64]) == TokenBudgets([64, 128])
    assert TokenBudgets([64], max_items=2) != TokenBudgets([64])
    assert len({TokenBudgets([64, 128]), TokenBudgets([128, 64])}) == 1
    assert repr(TokenBudgets([64, 128], max_items=4)) == "TokenBudgets([64, 128], max_items=4)"
