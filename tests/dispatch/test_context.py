"""The forward context: set/get, nesting, restoration on errors, and isolation between threads and tasks."""

from __future__ import annotations

import asyncio
import threading
from typing import Final

import pytest
from hypothesis import given

from cudagraph_dispatch import (
    BatchDescriptor,
    CUDAGraphMode,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from tests.strategies import forward_context_args, forward_context_extras

M: Final = CUDAGraphMode
KEY: Final = BatchDescriptor(8, num_reqs=8, uniform=True)


class _BoomError(Exception):
    """Raised inside a context to check that the previous one comes back."""


def test_no_context_outside() -> None:
    """Outside any set_forward_context there is no active context (wrappers then run eagerly)."""
    assert get_forward_context() is None


@given(forward_context_args, forward_context_extras)
def test_set_and_get(args: tuple[CUDAGraphMode, BatchDescriptor | None], extra: dict[str, object]) -> None:
    """Inside the block the context carries exactly the mode, descriptor and extras given; after it, none."""
    mode, key = args
    with set_forward_context(mode, key, **extra) as entered:
        active = get_forward_context()
        assert active is entered
        assert active.runtime_mode is mode
        assert active.batch_descriptor == key
        assert dict(active.extra) == extra
    assert get_forward_context() is None


def test_extra_is_read_only() -> None:
    """Extras are shared with every layer of the forward: none of them may change them for the others."""
    with set_forward_context(M.FULL, KEY, step=3) as context:
        with pytest.raises(TypeError):
            context.extra["step"] = 4  # type: ignore[index]  # the point: the mapping is read-only
        assert context.extra["step"] == 3


def test_nesting_restores_the_outer_context() -> None:
    """An inner context shadows the outer one and leaving it brings the outer one back."""
    with set_forward_context(M.NONE) as outer:
        with set_forward_context(M.FULL, KEY) as inner:
            assert get_forward_context() is inner
        assert get_forward_context() is outer
        assert outer.batch_descriptor is None
    assert get_forward_context() is None


def test_exception_restores_the_previous_context() -> None:
    """An exception inside a context still restores the one before, and propagates unchanged."""
    with set_forward_context(M.PIECEWISE, KEY.relaxed()) as outer:
        with pytest.raises(_BoomError), set_forward_context(M.FULL, KEY):
            raise _BoomError
        assert get_forward_context() is outer
    with pytest.raises(_BoomError), set_forward_context(M.FULL, KEY):
        raise _BoomError
    assert get_forward_context() is None


@pytest.mark.parametrize("mode", [M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
def test_config_modes_are_not_runtime_modes(mode: CUDAGraphMode) -> None:
    """A forward runs as NONE, PIECEWISE or FULL: a combined mode is a ValueError naming field and value."""
    with pytest.raises(ValueError, match=f"runtime_mode.*{mode.name}"):
        set_forward_context(mode, KEY)
    assert get_forward_context() is None


@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL])
def test_graph_mode_needs_a_descriptor(mode: CUDAGraphMode) -> None:
    """A graph mode without a descriptor has no key to capture or replay under: ValueError."""
    with pytest.raises(ValueError, match=r"batch_descriptor.*None") as info:
        set_forward_context(mode, None)
    assert mode.name in str(info.value)
    assert get_forward_context() is None


def test_none_mode_needs_no_descriptor() -> None:
    """Eager forwards (profiling, warm-up) have no graph key: NONE with no descriptor is valid."""
    with set_forward_context(M.NONE) as context:
        assert context == ForwardContext(M.NONE, None, context.extra)
        assert dict(context.extra) == {}


def test_threads_do_not_see_each_other() -> None:
    """Each thread has its own context: one thread's active decision never leaks into another."""
    barrier = threading.Barrier(2, timeout=10)
    seen: dict[str, list[ForwardContext | None]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def worker(name: str, mode: CUDAGraphMode, key: BatchDescriptor) -> None:
        try:
            seen[name].append(get_forward_context())
            with set_forward_context(mode, key, worker=name) as mine:
                barrier.wait()  # both threads are inside their own context now
                seen[name].append(get_forward_context())
                assert get_forward_context() is mine
                barrier.wait()  # neither leaves before the other has looked
            seen[name].append(get_forward_context())
        except BaseException as exc:  # surfaced on the main thread below
            errors.append(exc)
            barrier.abort()

    with set_forward_context(M.PIECEWISE, KEY.relaxed(), worker="main") as main_context:
        threads = [
            threading.Thread(target=worker, args=("a", M.FULL, KEY)),
            threading.Thread(target=worker, args=("b", M.PIECEWISE, BatchDescriptor(4))),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert get_forward_context() is main_context
    assert not errors, errors
    for name in ("a", "b"):
        before, inside, after = seen[name]
        assert before is None  # a new thread does not inherit the main thread's context
        assert after is None
        assert inside is not None
        assert inside.extra["worker"] == name


def test_asyncio_tasks_do_not_see_each_other() -> None:
    """Concurrent tasks interleave on one thread, yet each sees only the context it entered."""

    async def step(name: str, key: BatchDescriptor, log: list[tuple[str, bool]]) -> None:
        assert get_forward_context() is None
        with set_forward_context(M.FULL, key, task=name) as mine:
            for _ in range(5):
                await asyncio.sleep(0)  # hand over to the other task mid-context
                log.append((name, get_forward_context() is mine))
        assert get_forward_context() is None

    async def main() -> list[tuple[str, bool]]:
        log: list[tuple[str, bool]] = []
        await asyncio.gather(step("a", KEY, log), step("b", BatchDescriptor(4, 4), log))
        return log

    log = asyncio.run(main())
    assert sorted(log) == sorted([("a", True)] * 5 + [("b", True)] * 5)
    # The tasks really interleaved: a's entries are not all before b's.
    names = [name for name, _ in log]
    assert names != sorted(names)
    assert get_forward_context() is None
