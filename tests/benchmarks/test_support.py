"""The interleaved-timing statistics (CPU: no timing, just the arithmetic)."""

from __future__ import annotations

import pytest

from tests.benchmarks.support import Interleaved


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
