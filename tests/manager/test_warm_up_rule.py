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
from cudagraph_manager._graphs._table import PlannedGraph
from cudagraph_manager._graphs._warm_up import WarmUpRule, smallest_of_modes
from cudagraph_manager._values._batch import BatchShape

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
    rule, plan = _rule(), _plan()
    warm_ups = [rule.foreground(plan, ranks=False), rule.foreground(plan, ranks=True)]
    warm_ups += [rule.background(plan, "per_class"), rule.background(plan, "every_key")]
    for key in plan:
        rule.captured(key.descriptor)
    warm_ups += [rule.foreground(plan, ranks=False), rule.foreground(plan, ranks=True)]  # a recapture
    warm_ups += [rule.background(plan, "per_class"), rule.background(plan, "every_key")]  # a wake
    for warm_up in warm_ups:
        assert set(warm_up.keys) >= SMALLEST, warm_up.keys


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
    """Per class, as ``capture()``: here a class per mode, so each mode's largest (first use) and smallest."""
    rule, plan = _rule(), _plan()
    first = rule.background(plan, "per_class")
    assert first.keys == (
        BatchDescriptor(64),
        BatchDescriptor(8),
        BatchDescriptor(16, 16, True),
        BatchDescriptor(1, 1, True),
    )
    assert first.skippable == SMALLEST
    rule.captured(BatchDescriptor(64))  # a wake: the largest has its compiles
    again = rule.background(plan, "per_class")
    assert again.keys == (BatchDescriptor(8), BatchDescriptor(16, 16, True), BatchDescriptor(1, 1, True))


def test_a_mode_of_one_key_warms_it_as_its_largest_not_only_for_the_thread() -> None:
    plan = _keys(_Key(FULL, BatchDescriptor(4, 4, True)))
    warm_ups = _rule().background(plan, "per_class")
    assert warm_ups.keys == (BatchDescriptor(4, 4, True),)
    assert warm_ups.skippable == frozenset()  # never skipped: it is also the mode's largest


def test_a_thread_has_its_handles_only_after_it_warmed_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudagraph_manager._graphs import _warm_up

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
    from cudagraph_manager._graphs import _warm_up

    monkeypatch.setattr(_warm_up, "dynamo_compiles", lambda: 3)  # a model may recompile after new weights
    rule = _rule()
    assert not rule.thread_has_handles()
    for key in _plan():  # however many warm-ups and captures this thread ran
        rule.ran(key.descriptor, 0.5)
        assert not rule.thread_has_handles()
        rule.captured(key.descriptor)
        assert not rule.thread_has_handles()


def test_where_dynamo_compiles_a_wake_with_the_weights_kept_skips_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudagraph_manager._graphs import _warm_up

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


# -- capture()'s policy (``ManagerOptions.warm_ups``): per class or every key --------------------


def _mixed_plan() -> list[PlannedGraph[torch.Tensor]]:
    """FULL keys of two classes (mixed and uniform) and one LoRA class, largest first per class."""
    return _keys(
        *(_Key(FULL, BatchDescriptor(n, n)) for n in (64, 32, 8)),
        *(_Key(FULL, BatchDescriptor(n, n, True)) for n in (16, 4)),
        *(_Key(FULL, BatchDescriptor(n, n, has_lora=True, num_active_loras=1)) for n in (8, 2)),
        _Key(FULL, BatchDescriptor(1, 1, True)),
    )


def _no_dynamo(monkeypatch: pytest.MonkeyPatch, count: int | None = None) -> list[int | None]:
    """dynamo's compile count as the rule sees it (``None``: never loaded); the list's first item."""
    from cudagraph_manager import _compiled
    from cudagraph_manager._graphs import _warm_up

    counter = [count]
    monkeypatch.setattr(_warm_up, "dynamo_compiles", lambda: counter[0])
    monkeypatch.setattr(_compiled, "dynamo_compiles", lambda: counter[0])
    return counter


def _needed(plan: list[PlannedGraph[torch.Tensor]], warm_ups: object) -> tuple[BatchDescriptor, ...]:
    from cudagraph_manager._graphs._warm_up import ForegroundWarmUps

    assert isinstance(warm_ups, ForegroundWarmUps)
    return tuple(key.descriptor for key in plan if warm_ups.needs(key))


def test_per_class_warms_each_classes_first_key_and_each_modes_smallest() -> None:
    assert _rule().per_class(_plan()) == (
        BatchDescriptor(64),
        BatchDescriptor(8),
        BatchDescriptor(16, 16, True),
        BatchDescriptor(1, 1, True),
    )
    assert _rule().per_class(_mixed_plan()) == (
        BatchDescriptor(64, 64),
        BatchDescriptor(16, 16, True),
        BatchDescriptor(8, 8, has_lora=True, num_active_loras=1),
        BatchDescriptor(1, 1, True),  # the mode's smallest: the thread's handles
    )


def test_per_class_skips_a_class_warmed_before_but_not_the_modes_smallest() -> None:
    rule, plan = _rule(), _mixed_plan()
    rule.captured(BatchDescriptor(32, 32))  # a mixed key warmed up before: its class has its first use
    assert rule.per_class(plan) == (
        BatchDescriptor(16, 16, True),
        BatchDescriptor(8, 8, has_lora=True, num_active_loras=1),
        BatchDescriptor(1, 1, True),
    )


@pytest.mark.parametrize(
    ("policy", "count", "ranks", "per_class"),
    [
        ("auto", None, False, True),  # dynamo never loaded
        ("auto", 0, False, True),  # loaded (an import), nothing compiled
        ("auto", 3, False, False),  # a compiled model: every key
        ("auto", None, True, False),  # ranks: every rank the same warm-ups, every key
        ("per_class", 3, False, True),
        ("per_class", None, True, False),
        ("every_key", None, False, False),
    ],
)
def test_the_policy_picks_per_class_only_where_it_may(
    monkeypatch: pytest.MonkeyPatch, policy: str, count: int | None, ranks: bool, per_class: bool
) -> None:
    _no_dynamo(monkeypatch, count)
    plan = _mixed_plan()
    warm_ups = _rule().for_capture(plan, policy, ranks=ranks)  # type: ignore[arg-type]  # the names, as strings
    expected = _rule().per_class(plan) if per_class else _descriptors(plan)
    assert _needed(plan, warm_ups) == expected
    assert warm_ups.per_class is per_class


def test_a_compile_warms_the_classes_next_key_up_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per class, a capture that made dynamo compile warms its class's next key up; one that did not, not."""
    counter = _no_dynamo(monkeypatch, 0)
    plan = _mixed_plan()
    warm_ups = _rule().for_capture(plan, "per_class", ranks=False)
    mixed_64, mixed_32, mixed_8 = plan[:3]
    with warm_ups.watch(mixed_64):
        counter[0] = 1  # the first size compiled
    assert warm_ups.needs(mixed_32)
    assert not warm_ups.needs(plan[3 + 1])  # another class: untouched
    with warm_ups.watch(mixed_32):
        pass  # a dynamic graph: no compile for this size
    assert not warm_ups.needs(mixed_8)


def test_under_auto_a_compile_turns_the_rest_of_the_capture_to_every_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = _no_dynamo(monkeypatch, None)
    plan = _mixed_plan()
    warm_ups = _rule().for_capture(plan, "auto", ranks=False)
    assert not warm_ups.needs(plan[1])
    with warm_ups.watch(plan[0]):
        counter[0] = 1  # a model compiled at its first call, inside capture()
    assert _needed(plan, warm_ups) == _descriptors(plan)


def _capture_log(fail_cold: bool, error: Exception) -> tuple[list[bool], object]:
    calls: list[bool] = []

    def capture(descriptor: BatchDescriptor, /, *, warm: bool) -> object:
        calls.append(warm)
        if not (fail_cold and warm):  # fails always, or only without a warm-up
            raise error
        return ("captured", descriptor)

    return calls, capture


def test_a_recording_without_a_warm_up_that_fails_is_retried_after_its_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cudagraph_capture import CaptureInvalidatedError

    _no_dynamo(monkeypatch)
    plan = _mixed_plan()
    warm_ups = _rule().for_capture(plan, "per_class", ranks=False)
    calls, capture = _capture_log(
        True, CaptureInvalidatedError("an autotune synchronized inside the capture", plan[1].descriptor)
    )
    assert warm_ups.capture(plan[1], capture) == ("captured", plan[1].descriptor)  # type: ignore[arg-type,comparison-overlap]  # a stand-in capture
    assert calls == [False, True]


def test_a_failure_is_retried_only_where_a_warm_up_may_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not after a warm-up, not a refusal (capture disabled), not the output's check; a retry's own raises.

    Decided on the types along the cause chain: the text says nothing.
    """
    from cudagraph_capture import CaptureDisabledError, CaptureError, CaptureInvalidatedError

    _no_dynamo(monkeypatch)
    plan = _mixed_plan()
    warm_ups = _rule().for_capture(plan, "per_class", ranks=False)
    warmed, cold = plan[0], plan[1]
    first_use = CaptureInvalidatedError("a synchronization inside the capture", cold.descriptor)
    wrapped_first_use = CaptureError("the recording failed", cold.descriptor)
    wrapped_first_use.__cause__ = CaptureInvalidatedError("CUDA invalidated the capture")
    out_of_memory = CaptureError("the recording failed", cold.descriptor)
    out_of_memory.__cause__ = torch.OutOfMemoryError("out of memory")
    out_of_memory.__cause__.__context__ = CaptureInvalidatedError("CUDA invalidated the capture")
    cases: list[tuple[PlannedGraph[torch.Tensor], Exception, list[bool]]] = [
        (warmed, CaptureInvalidatedError("invalidated", warmed.descriptor), [True]),
        (cold, CaptureDisabledError("disabled", cold.descriptor), [False]),
        (cold, ValueError("an output that cannot be cut"), [False]),
        (cold, CaptureError("the model failed", cold.descriptor), [False]),  # its own error
        (cold, CaptureError("operation not permitted when stream is capturing", cold.descriptor), [False]),
        (cold, out_of_memory, [False]),  # an out-of-memory anywhere in the chain: never
        (cold, first_use, [False, True]),  # the retry's error
        (cold, wrapped_first_use, [False, True]),
    ]
    rule = _rule()
    rule.captured(cold.descriptor)  # a recapture: cold under "every_key" too, never retried
    recapture = rule.for_capture(plan, "per_class", ranks=False)
    calls, capture = _capture_log(False, first_use)
    with pytest.raises(CaptureError):
        recapture.capture(cold, capture)  # type: ignore[arg-type]  # a stand-in capture
    assert calls == [False]
    for graph, error, expected in cases:
        calls, capture = _capture_log(False, error)
        with pytest.raises(type(error)):
            warm_ups.capture(graph, capture)  # type: ignore[arg-type]  # a stand-in capture
        assert calls == expected


def test_a_failure_chain_that_loops_is_read_once() -> None:
    """A cause chain set by hand into a loop ends the walk: the model's error is not worth a retry."""
    from cudagraph_capture import CaptureError, CaptureInvalidatedError
    from cudagraph_manager._graphs._recording import worth_retrying

    error = CaptureError("the recording failed")
    cause = RuntimeError("the model failed")
    error.__cause__, cause.__cause__ = cause, error
    assert not worth_retrying(error)
    cause.__context__ = CaptureInvalidatedError("CUDA invalidated the capture")
    cause.__cause__ = None
    assert worth_retrying(error)


# -- compile classes: the attention says which shapes share compiled code -------------------------


class _Builder:
    """A stand-in attention declaring compile classes: 1 token, up to 16, more."""

    def compile_class(self, shape: BatchShape, /) -> object:
        return min(shape.num_tokens, 2) if shape.num_tokens < 16 else "16+"


class _ClassedKey(NamedTuple):
    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    builder: object
    shape: BatchShape


def _classed_plan() -> list[PlannedGraph[torch.Tensor]]:
    """FULL mixed keys 64, 32, 16 | 8, 4, 2 | 1 (three compile classes), largest first."""
    keys = [BatchDescriptor(n, n) for n in (64, 32, 16, 8, 4, 2, 1)]
    builder = _Builder()
    return cast(
        list[PlannedGraph[torch.Tensor]],
        [_ClassedKey(FULL, d, builder, BatchShape.of_key(FULL, d, d.num_tokens)) for d in keys],
    )


def test_a_declared_compile_class_is_part_of_the_warm_up_class() -> None:
    from cudagraph_manager._graphs._warm_up import declares_compile_classes, warm_up_class

    plan = _classed_plan()
    assert declares_compile_classes(plan)
    assert not declares_compile_classes(_plan())  # stand-ins without an attention
    assert len({warm_up_class(key) for key in plan}) == 3
    assert _rule().per_class(plan) == (BatchDescriptor(64, 64), BatchDescriptor(8, 8), BatchDescriptor(1, 1))


@pytest.mark.parametrize("policy", ["auto", "per_class"])
def test_with_declared_classes_a_compiled_model_warms_per_compile_class(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """dynamo compiled before: ``"auto"`` stays per class where the attention declares its classes."""
    counter = _no_dynamo(monkeypatch, 3)
    plan = _classed_plan()
    warm_ups = _rule().for_capture(plan, policy, ranks=False)  # type: ignore[arg-type]  # the names, as strings
    assert _needed(plan, warm_ups) == (BatchDescriptor(64, 64), BatchDescriptor(8, 8), BatchDescriptor(1, 1))
    with warm_ups.watch(plan[0], warm=True):
        counter[0] = (counter[0] or 0) + 1  # the class's first warm-up compiles its code: expected
    assert not warm_ups.needs(plan[1])  # neither the next key of the class nor every key
    with warm_ups.watch(plan[3], warm=True):
        counter[0] = (counter[0] or 0) + 1
    assert _needed(plan, warm_ups) == (BatchDescriptor(64, 64), BatchDescriptor(8, 8), BatchDescriptor(1, 1))


def test_a_recording_that_compiled_is_recorded_again_after_its_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A class the declaration missed: the cold recording compiled, so it is recorded again, warmed up,
    and the class's next key warms up too."""
    counter = _no_dynamo(monkeypatch, 0)
    plan = _classed_plan()
    warm_ups = _rule().for_capture(plan, "auto", ranks=False)
    calls: list[bool] = []

    def capture(descriptor: BatchDescriptor, /, *, warm: bool) -> object:
        calls.append(warm)
        if not warm:
            counter[0] = (counter[0] or 0) + 1  # a compile inside the recording
        return ("captured", descriptor, warm)

    assert warm_ups.capture(plan[1], capture) == ("captured", plan[1].descriptor, True)  # type: ignore[arg-type,comparison-overlap]  # a stand-in capture
    assert calls == [False, True]
    assert warm_ups.needs(plan[2])  # the class compiled where it should not have: its next key warms up
    calls.clear()
    assert warm_ups.capture(plan[4], capture) == ("captured", plan[4].descriptor, True)  # type: ignore[arg-type,comparison-overlap]  # a stand-in capture
    assert calls == [False, True]


def test_a_recording_that_failed_while_compiling_is_retried_after_its_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model's own error is raised at once, unless dynamo compiled during the recording."""
    from cudagraph_capture import CaptureError

    counter = _no_dynamo(monkeypatch, 0)
    plan = _classed_plan()
    warm_ups = _rule().for_capture(plan, "auto", ranks=False)
    calls: list[bool] = []

    def capture(descriptor: BatchDescriptor, /, *, warm: bool) -> object:
        calls.append(warm)
        if not warm:
            counter[0] = (counter[0] or 0) + 1
            raise CaptureError("inductor failed inside the capture", descriptor)
        return ("captured", descriptor)

    assert warm_ups.capture(plan[1], capture) == ("captured", plan[1].descriptor)  # type: ignore[arg-type,comparison-overlap]  # a stand-in capture
    assert calls == [False, True]


def test_the_background_follows_the_captures_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same keys as ``capture()``: per compile class, or every first use under ``"every_key"``;
    a mode's smallest is skippable only where it warms up for the thread alone."""
    _no_dynamo(monkeypatch, 3)
    rule, plan = _rule(), _classed_plan()
    per_class = rule.background(plan, "auto")
    assert per_class.keys == (BatchDescriptor(64, 64), BatchDescriptor(8, 8), BatchDescriptor(1, 1))
    assert per_class.skippable == frozenset()  # the smallest is its class's first use
    every = rule.background(plan, "every_key")
    assert every.keys == tuple(key.descriptor for key in plan)
    assert every.skippable == frozenset()
    for key in plan:
        rule.captured(key.descriptor)
    wake = rule.background(plan, "auto")
    assert wake.keys == (BatchDescriptor(1, 1),)
    assert wake.skippable == frozenset({BatchDescriptor(1, 1)})  # only for the thread's handles
    assert rule.background(plan, "every_key") == wake


def test_the_warmed_classes_are_those_of_keys_warmed_before() -> None:
    from cudagraph_manager._graphs._warm_up import warm_up_class

    rule, plan = _rule(), _classed_plan()
    assert rule.warmed_classes(plan) == frozenset()
    rule.ran(BatchDescriptor(32, 32), 0.1)
    assert rule.warmed_classes(plan) == {warm_up_class(plan[0])}
