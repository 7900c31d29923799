"""The warm-up rule (``WarmUpRule``): one object for ``capture()``, the background capture, the estimate.

Stand-in keys carry what the rule reads (a mode and a descriptor); a plan is
largest first, PIECEWISE keys then FULL ones, as the dispatcher's.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, cast

import pytest
import torch

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from cudagraph_manager._capture._warm_up import WarmUpRule, smallest_of_modes
from cudagraph_manager._graphs import PlannedGraph

PIECEWISE, FULL = CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


class _Key(NamedTuple):
    mode: CUDAGraphMode
    descriptor: BatchDescriptor


def _keys(*keys: _Key) -> list[PlannedGraph[torch.Tensor]]:
    """Stand-ins typed as planned keys: the rule reads their mode and descriptor only."""
    return cast(list[PlannedGraph[torch.Tensor]], list(keys))


def _plan() -> list[PlannedGraph[torch.Tensor]]:
    return _keys(
        *(_Key(PIECEWISE, BatchDescriptor(n)) for n in (64, 32, 8)),
        *(_Key(FULL, BatchDescriptor(n, n, True)) for n in (16, 4, 1)),
    )


def _rule() -> WarmUpRule[torch.Tensor]:
    return WarmUpRule()


def _descriptors(keys: list[PlannedGraph[torch.Tensor]]) -> tuple[BatchDescriptor, ...]:
    return tuple(key.descriptor for key in keys)


SMALLEST = frozenset({BatchDescriptor(8), BatchDescriptor(1, 1, True)})


def test_a_first_capture_warms_every_key_up_and_skips_none() -> None:
    warm_ups = _rule().foreground(_plan(), ranks=False)
    assert warm_ups.keys == _descriptors(_plan())
    assert warm_ups.skippable == frozenset()  # the foreground never skips


def test_each_modes_smallest_is_the_one_every_capture_warms() -> None:
    assert smallest_of_modes(_plan()) == SMALLEST


def test_a_recapture_warms_up_only_each_modes_smallest() -> None:
    rule, plan = _rule(), _plan()
    for key in plan:
        rule.captured(key.descriptor)
    assert rule.foreground(plan, ranks=False).keys == (BatchDescriptor(8), BatchDescriptor(1, 1, True))


def test_with_ranks_every_key_warms_up_whatever_was_warmed_before() -> None:
    rule, plan = _rule(), _plan()
    for key in plan:
        rule.captured(key.descriptor)
    assert rule.foreground(plan, ranks=True).keys == _descriptors(plan)


def test_the_background_warms_each_modes_largest_not_warmed_before_and_its_smallest() -> None:
    rule, plan = _rule(), _plan()
    first = rule.background(plan)
    assert first.keys == (
        BatchDescriptor(64),
        BatchDescriptor(8),
        BatchDescriptor(16, 16, True),
        BatchDescriptor(1, 1, True),
    )
    assert first.skippable == SMALLEST
    rule.captured(BatchDescriptor(64))  # a wake: the largest has its compiles
    again = rule.background(plan)
    assert again.keys == (BatchDescriptor(8), BatchDescriptor(16, 16, True), BatchDescriptor(1, 1, True))


def test_a_mode_of_one_key_warms_it_as_its_largest_not_only_for_the_thread() -> None:
    plan = _keys(_Key(FULL, BatchDescriptor(4, 4, True)))
    warm_ups = _rule().background(plan)
    assert warm_ups.keys == (BatchDescriptor(4, 4, True),)
    assert warm_ups.skippable == frozenset()  # never skipped: it is also the mode's largest


def test_a_thread_has_its_handles_only_after_it_warmed_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudagraph_manager._capture import _warm_up

    monkeypatch.setattr(_warm_up, "dynamo_compiles", lambda: None)  # no compiled model loaded
    rule = _rule()
    assert not rule.thread_has_handles()
    rule.ran(BatchDescriptor(8), 0.5)
    assert rule.thread_has_handles()
    other: list[bool] = []
    thread = threading.Thread(target=lambda: other.append(rule.thread_has_handles()))
    thread.start()
    thread.join()
    assert other == [False]  # per thread: a new one creates its own handles


def test_where_dynamo_compiles_a_thread_warm_up_is_never_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudagraph_manager._capture import _warm_up

    monkeypatch.setattr(_warm_up, "dynamo_compiles", lambda: 3)  # a model may recompile after new weights
    rule = _rule()
    rule.ran(BatchDescriptor(8), 0.5)
    assert not rule.thread_has_handles()


def test_where_dynamo_compiles_a_wake_with_the_weights_kept_skips_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudagraph_manager._capture import _warm_up

    monkeypatch.setattr(_warm_up, "dynamo_compiles", lambda: 3)
    rule = _rule()
    assert not rule.thread_has_handles(weights_kept=True)  # a new thread still needs its handles
    rule.ran(BatchDescriptor(8), 0.5)
    assert rule.thread_has_handles(weights_kept=True)  # the same tensors: no guard changed
    assert not rule.thread_has_handles(weights_kept=False)


def test_a_warm_up_run_earlier_is_reported_once() -> None:
    rule = _rule()
    rule.ran(BatchDescriptor(8), 0.25)
    assert rule.unreported(BatchDescriptor(8)) == 0.25
    rule.captured(BatchDescriptor(8))
    assert rule.unreported(BatchDescriptor(8)) == 0.0
    plan = _keys(_Key(PIECEWISE, BatchDescriptor(16)), _Key(PIECEWISE, BatchDescriptor(8)))
    assert rule.foreground(plan, ranks=False).keys == (BatchDescriptor(16), BatchDescriptor(8))
