"""The step path stays short: what a FULL ``run()`` calls before the graph replays.

Measured with a profiler hook on a replayed step (the fake engine's entry
stands for the graph): the frames of ours between ``run`` and ``replay``, every
Python function the step calls before the replay and after it (any file: a
NamedTuple's generated ``__new__`` counts too), and the hashes of the batch key
(one look-up). Limits, not a pinned call stack: the step may be reshaped, never
lengthened.
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Final

import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, ManagerOptions

from .helpers import INPUTS, FakeEngines, FakeEntry, ToyModel, config_for, make_batch

CPU: Final = torch.device("cpu")


def _trace_step(mode: CUDAGraphMode) -> tuple[list[str], list[tuple[str, str]], int, list[tuple[str, str]]]:
    """(our frames at the replay, functions called before it, key hashes before it, functions after it)."""
    manager = CUDAGraphManager(
        ToyModel(CPU),
        INPUTS,
        config_for(mode),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines()),
    )
    manager.capture(progress=False)
    batch = make_batch(5, 3, CPU, seed=0)
    manager.run_batch(batch)  # the first step cuts its views; the traced one is a usual step
    stack: list[str] = []
    calls: list[tuple[str, str]] = []
    after: list[tuple[str, str]] = []
    hashes = 0
    replay_code = FakeEntry._replay.__code__
    members = [getattr(m, "fget", m) for m in vars(FakeEntry).values()]  # its properties' getters too
    fake = {f.__code__ for f in members if inspect.isfunction(f)}  # the fake entry stands for the graph

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal hashes
        if event != "call":
            return
        code = frame.f_code
        here = (code.co_filename.rsplit("/", 1)[-1], code.co_name)
        if stack:  # after the replay: the functions it (and the count and cut) call directly
            if frame.f_back is not None and frame.f_back.f_code.co_name in _STEP_FRAMES:
                after.append(here)
        elif code is replay_code:
            stack.extend(f.function for f in inspect.getouterframes(frame)[1:] if "cudagraph_" in f.filename)
        elif code.co_name == "__hash__":
            hashes += 1
        elif code not in fake:
            calls.append(here)

    sys.setprofile(profile)
    try:
        manager.run_batch(batch)
    finally:
        sys.setprofile(None)
    return stack, calls, hashes, after


#: The functions whose direct calls after the replay are counted: the step's own frames.
_STEP_FRAMES: Final = frozenset({"run", "run_batch"})
#: Our frames between ``run_batch`` and a FULL graph's replay: the step function alone.
MAX_FRAMES: Final = 1
#: Functions a FULL step calls before the replay, the entry point not counted: the step
#: function, the inputs' check, the route, the weights' flag and the copy-in.
MAX_CALLS: Final = 5
#: Functions the step calls after the replay: the cut of the outputs and the count.
MAX_CALLS_AFTER: Final = 2


def test_a_full_step_stays_short() -> None:
    stack, calls, hashes, after = _trace_step(CUDAGraphMode.FULL)
    assert stack[-1] == "run_batch", stack
    assert len(stack) - 1 <= MAX_FRAMES, stack
    inner = calls[1:]  # after run_batch itself
    assert len(inner) <= MAX_CALLS, inner
    assert len(set(inner)) == len(inner), f"a function called twice: {inner}"
    assert hashes == 1, "one look-up of the key per step"
    assert len(after) <= MAX_CALLS_AFTER, after


def test_a_piecewise_step_only_adds_its_forward_context() -> None:
    stack, calls, hashes, _ = _trace_step(CUDAGraphMode.PIECEWISE)
    full_stack, full_calls, _, _ = _trace_step(CUDAGraphMode.FULL)
    assert len(stack) <= len(full_stack), (stack, full_stack)  # set in the step: no frame of its own
    assert len(calls) <= len(full_calls), (calls, full_calls)
    assert hashes == 1
