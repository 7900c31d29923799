"""The stats' old names (before one name per concept) warn and answer what the new ones do."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from cudagraph_manager import ManagerStats


def _stats() -> ManagerStats:
    return ManagerStats(
        replays=MappingProxyType({}),
        eager_steps=7,
        uncaptured_steps=3,
        padded_tokens=0,
        eager_reasons=MappingProxyType({"not_captured": 3, "above_largest_size": 4}),
        idle_steps=0,
        dummy_steps=0,
    )


@pytest.mark.parametrize(
    ("old", "new"), [("eager_runs", "eager_steps"), ("uncaptured_runs", "uncaptured_steps")]
)
def test_an_old_stats_name_warns_and_answers_the_new_ones_count(old: str, new: str) -> None:
    stats = _stats()
    with pytest.warns(
        DeprecationWarning, match=rf"ManagerStats\.{old} is deprecated: it is ManagerStats\.{new}"
    ):
        value = getattr(stats, old)
    assert value == getattr(stats, new)
