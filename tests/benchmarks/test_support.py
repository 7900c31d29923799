"""The interleaved-timing statistics (CPU: no timing, just the arithmetic)."""

from __future__ import annotations

import pytest

from tests.benchmarks.support import Interleaved, Spread, record_interleaved, rotated


def test_ratio_pairs_rounds_where_medians_would_not() -> None:
    # Round 3 is slow for both (the host slowed down for a while); round 2's
    # eager alone ran into a hiccup. Paired by round, the ratio is 0.2; the
    # ratio of the two medians (1.0 / 10.0) would halve it.
    timed = Interleaved({"graph": [1.0, 1.0, 2.0], "eager": [5.0, 10.0, 10.0]})
    assert timed.median("graph") / timed.median("eager") == pytest.approx(0.1)
    assert timed.ratio("graph", "eager") == pytest.approx(0.2)
    assert timed.ratio("eager", "graph") == pytest.approx(5.0)


def test_ratio_is_the_median_of_round_ratios() -> None:
    timed = Interleaved({"a": [2.0, 3.0, 10.0], "b": [1.0, 1.0, 1.0]})
    assert timed.ratio("a", "b") == pytest.approx(3.0)


def test_ratio_needs_one_sample_per_round_on_both_sides() -> None:
    with pytest.raises(ValueError, match="zip"):
        Interleaved({"a": [1.0, 2.0], "b": [1.0]}).ratio("a", "b")


def test_spread_gives_extremes_and_quartiles_of_the_round_ratios() -> None:
    timed = Interleaved({"a": [1.0, 2.0, 3.0, 4.0, 5.0], "b": [1.0] * 5})
    spread = timed.spread("a", "b")
    assert (spread.low, spread.q1, spread.q3, spread.high) == pytest.approx((1.0, 2.0, 4.0, 5.0))
    assert str(spread) == "1.000..5.000 (IQR 2.000..4.000)"


def test_spread_of_one_round_and_of_none() -> None:
    assert Spread.of([1.5]) == Spread(1.5, 1.5, 1.5, 1.5)
    with pytest.raises(ValueError, match="at least one"):
        Spread.of([])


def test_minus_gives_what_each_candidate_adds_round_by_round() -> None:
    # Per break: ours adds 2 and 4 over the one graph, the peer 4 and 4; round 2 is slow for all.
    timed = Interleaved({"one": [10.0, 20.0], "ours": [12.0, 24.0], "peer": [14.0, 24.0]})
    added = timed.minus("one")
    assert set(added.samples) == {"ours", "peer"}
    assert added.samples["ours"] == pytest.approx([2.0, 4.0])
    assert added.ratio("ours", "peer") == pytest.approx(0.75)
    assert added.rounds == 2


def test_record_interleaved_writes_medians_ratios_and_spreads() -> None:
    timed = Interleaved({"a": [2e-6, 4e-6, 6e-6], "b": [2e-6, 2e-6, 2e-6]})
    info: dict[str, object] = {}
    record_interleaved(info, timed, {"a_over_b": ("a", "b")}, per_call=2)
    assert info["a_us"] == pytest.approx(2.0)
    assert info["b_us"] == pytest.approx(1.0)
    assert info["a_over_b"] == pytest.approx(2.0)
    assert info["a_over_b_spread"] == "1.000..3.000 (IQR 1.500..2.500)"
    assert info["interleaved_rounds"] == 3


def test_rotated_starts_each_round_at_the_next_candidate() -> None:
    names = ["a", "b", "c"]
    assert [rotated(names, index) for index in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert rotated([], 3) == []
