"""The step path stays short: what a FULL ``run()`` calls before the graph replays.

Measured with a profiler hook on a replayed step (the fake engine's entry
stands for the graph): the frames between ``run`` and ``replay`` (the manager's
step function alone), the distinct functions of ours the step calls before
the replay (the checks and the copy-in of the buffers module, the
dispatcher's route), and the hashes of the batch key (one look-up).
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Final

import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager

from .helpers import INPUTS, FakeEngines, FakeEntry, ToyModel, config_for, make_batch

CPU: Final = torch.device("cpu")


def _trace_step(mode: CUDAGraphMode) -> tuple[list[str], list[tuple[str, str]], int]:
    """(our frames at the replay, our functions called before it, key hashes before it) of one step."""
    manager = CUDAGraphManager(
        ToyModel(CPU), INPUTS, config_for(mode), device="cpu", engine_factory=FakeEngines()
    )
    manager.capture(progress=False)
    batch = make_batch(5, 3, CPU, seed=0)
    manager.run_batch(batch)  # the first step cuts its views; the traced one is a usual step
    stack: list[str] = []
    calls: list[tuple[str, str]] = []
    hashes = 0
    replay_code = FakeEntry._replay.__code__

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal hashes
        if event != "call" or stack:
            return
        code = frame.f_code
        if code is replay_code:
            stack.extend(f.function for f in inspect.getouterframes(frame)[1:] if "cudagraph_" in f.filename)
        elif code.co_name == "__hash__":
            hashes += 1
        elif "cudagraph_" in code.co_filename:
            calls.append((code.co_filename.rsplit("/", 1)[-1], code.co_name))

    sys.setprofile(profile)
    try:
        manager.run_batch(batch)
    finally:
        sys.setprofile(None)
    return stack, calls, hashes


def test_a_full_step_is_the_step_function_the_buffers_and_the_route() -> None:
    stack, calls, hashes = _trace_step(CUDAGraphMode.FULL)
    assert stack == ["_step", "run_batch"], "run -> _step -> entry.replay(), nothing between"
    assert dict.fromkeys(calls) == dict.fromkeys(
        [
            ("_manager.py", "run_batch"),
            ("_manager.py", "_step"),
            ("_buffers.py", "check"),  # StaticBuffers.check: the per-input checks are inline
            ("_dispatcher.py", "route"),
            ("_weights.py", "moved"),  # WeightWatch.moved: a flag and one data_ptr(), before copy_in
            ("_buffers.py", "copy_in"),
        ]
    ), calls
    assert len(calls) == 6, "each called once"
    assert hashes == 1, "one look-up of the key per step"


def test_a_piecewise_step_only_adds_its_forward_context() -> None:
    stack, calls, hashes = _trace_step(CUDAGraphMode.PIECEWISE)
    assert stack == ["_step", "run_batch"]
    assert len(calls) == 6, calls
    assert hashes == 1
