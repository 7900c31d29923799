"""The background capture attacked where it could corrupt a step (GPU).

Each test is built to fail on a capture that is not ordered with the serving
stream, that runs anything on the device while steps are served, or that
writes memory a caller still reads: the model writes a scratch buffer of its
own in every forward and reads it back behind a long kernel; steps are
queued behind long kernels before ``start_capture()`` is called; outputs are
held and read late, after the capture did its work. Every step is compared
with the same step run eagerly on an identical copy of the model that no
capture ever touches.

- ``test_a_replay_queued_before_start_capture_reads_its_own_inputs``: a step
  replays behind a long kernel, then ``start_capture()``: the capture's first
  fill of the static buffers must wait for it.
- ``test_steps_of_a_model_with_a_workspace_stay_exact_during_the_capture``:
  the capture runs the model (warm-ups) while steps are served eagerly and
  replayed; both write the model's scratch buffer.
- ``test_the_last_outputs_survive_a_background_capture``: the output of a
  replay, held with no further ``run()``, while smaller keys are captured
  into the same pool (largest first: they may be handed its memory).
- ``test_random_interleavings_never_corrupt_a_step``: thousands of steps of
  random sizes with host gaps, long kernels, held outputs, ``start_capture``,
  ``clear`` and failing captures, in every mode.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections.abc import Iterator
from typing import Final

import pytest
import torch
from torch import nn

from cudagraph_capture import CaptureError
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from cudagraph_manager import BackgroundCapture, CUDAGraphManager
from tests.torch_support import as_tensor, highest_fp32_matmul_precision, rel_err

from .helpers import DIM, INPUTS, TOL, ToyModel, config_for, make_batch

pytestmark = pytest.mark.gpu

MODES: Final = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)
#: Capture sizes of these tests: a step of 100 tokens replays the graph of 128.
SIZES: Final = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_NUM_SEQS: Final = 16
#: A long kernel (tens of ms): a missing stream dependency becomes a wrong result, not a lucky race.
LONG_CYCLES: Final = 50_000_000
#: The model's own long kernel between its scratch write and read (about 0.1 ms).
MODEL_CYCLES: Final = 200_000
WAIT_S: Final = 120.0
RECORD_DELAY_S: Final = 0.004
#: Steps of the stress test per mode (the target is at least 5,000).
STRESS_STEPS: Final = 5_000


class WorkspaceModel(nn.Module):
    """``ToyModel`` through a scratch buffer of its own: written every forward, read behind a long kernel.

    ``fail_recording_at`` makes the recording of those token counts raise (a
    model error at one size); eager steps and warm-ups of them still work.
    """

    def __init__(self, device: torch.device, cycles: int = MODEL_CYCLES) -> None:
        super().__init__()
        self.toy = ToyModel(device)
        self.scratch = torch.zeros(max(SIZES) + 8, DIM, device=device)  # [max rows, DIM]
        self.cycles = cycles
        self.fail_recording_at: set[int] = set()
        #: Host time a recording takes on top (a larger model's): steps are served during the capture.
        self.record_delay_s = RECORD_DELAY_S

    def forward(
        self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        rows = x.shape[0]
        if torch.cuda.is_current_stream_capturing():
            if rows in self.fail_recording_at:
                raise RuntimeError(f"planted model error while recording {rows} tokens")
            time.sleep(self.record_delay_s)
        scratch = self.scratch[:rows]
        scratch.copy_(x)  # the workspace write
        if self.cycles:
            torch._C._cuda_sleep(self.cycles)  # a long kernel before the workspace is read
        return self.toy.hidden(ids, scratch, scale, bias)

    def eager(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return as_tensor(self(**batch))


@contextlib.contextmanager
def _serving() -> Iterator[torch.cuda.Stream]:
    """Steps on a stream of their own (never the legacy default stream), fp32 matmuls in full fp32."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    with highest_fp32_matmul_precision(), torch.no_grad(), torch.cuda.stream(stream):
        yield stream


def _build(mode: CUDAGraphMode) -> tuple[WorkspaceModel, WorkspaceModel, CUDAGraphManager[torch.Tensor]]:
    """The served model, its untouched twin (no long kernel) for references, and a manager."""
    torch.manual_seed(0)
    model = WorkspaceModel(torch.device("cuda"))
    twin = copy.deepcopy(model)
    twin.cycles = 0
    config = config_for(mode, sizes=SIZES, max_num_seqs=MAX_NUM_SEQS)
    return model, twin, CUDAGraphManager(model, INPUTS, config)


def _capture_until(manager: CUDAGraphManager[torch.Tensor], model: WorkspaceModel, failing: int) -> None:
    """``capture()`` stopped by a model error at ``failing`` tokens: the keys before it are captured.

    Keys are captured in plan order (PIECEWISE, then FULL, largest first) and
    a failure keeps the keys before it, so exactly the plan's keys before the
    first key of ``failing`` tokens hold a graph. Each key is probed with a
    step that the dispatcher routes to it: it replays if and only if captured.
    """
    plan = [(mode, key) for mode, keys in manager.dispatcher.capture_plan() for key in keys]
    failed_at = next(i for i, (_, key) in enumerate(plan) if key.num_tokens == failing)
    expected = {key for _, key in plan[:failed_at]}
    model.fail_recording_at = {failing}
    with pytest.raises(CaptureError, match=f"planted model error while recording {failing} tokens") as caught:
        manager.capture(progress=False)
    model.fail_recording_at = set()
    assert caught.value.descriptor == plan[failed_at][1]
    assert expected
    assert all(key.num_tokens > failing for key in expected)
    assert manager.num_captured == len(expected)
    replayed: set[BatchDescriptor] = set()
    with torch.no_grad():
        for mode, key in plan:
            assert manager.dispatcher.dispatch(key.num_tokens, uniform_decode=key.uniform) == (mode, key)
            num_reqs = key.num_reqs or min(key.num_tokens, MAX_NUM_SEQS)
            batch = make_batch(key.num_tokens, num_reqs, torch.device("cuda"), seed=key.num_tokens)
            replays = manager.stats.num_replays
            manager.run_batch(batch, uniform_decode=key.uniform)
            if manager.stats.num_replays == replays + 1:
                replayed.add(key)
    torch.cuda.synchronize()
    manager.reset_stats()  # the probes' steps are not the test's
    assert replayed == expected


@contextlib.contextmanager
def _waited(handles: list[BackgroundCapture]) -> Iterator[list[BackgroundCapture]]:
    """The handles, each waited for on the way out, a failed test too: no capture thread outlives a test."""
    try:
        yield handles
    finally:
        for handle in handles:
            handle.wait(WAIT_S)


def _finish(handle: BackgroundCapture) -> None:
    handle.wait(WAIT_S)
    assert handle.errors == (), handle.errors


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_a_replay_queued_before_start_capture_reads_its_own_inputs(mode: CUDAGraphMode) -> None:
    for trial in range(3):
        model, twin, manager = _build(mode)
        _capture_until(manager, model, failing=16)
        with _serving() as stream:
            batch = make_batch(100, 5, torch.device("cuda"), seed=trial)
            expected = twin.eager(batch)
            replays = manager.stats.num_replays
            torch._C._cuda_sleep(LONG_CYCLES)  # the replay below waits behind this on the device
            out = manager.run_batch(batch)
            assert manager.stats.num_replays == replays + 1  # the graph of 128, queued
            handle = manager.start_capture()
            got = out.clone()  # read after start_capture(): the outputs of the last run() stay valid
            _finish(handle)
            stream.synchronize()
        err = rel_err(got, expected)
        assert err < TOL, f"trial {trial}: the queued replay computed on other inputs ({err:.2e})"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_steps_of_a_model_with_a_workspace_stay_exact_during_the_capture(mode: CUDAGraphMode) -> None:
    _, twin, manager = _build(mode)
    rng = random.Random(1)
    wrong: list[str] = []
    served = during = 0
    with _serving() as stream:
        torch._C._cuda_sleep(LONG_CYCLES)  # queued work the capture's warm-ups must wait for
        with _waited([manager.start_capture()]) as (handle,):
            while not handle.done or served < 101:
                tokens = rng.randint(1, max(SIZES) + 8)  # some above the largest size: eager
                batch = make_batch(
                    tokens, min(tokens, rng.randint(1, MAX_NUM_SEQS)), torch.device("cuda"), seed=served
                )
                expected = twin.eager(batch)
                during += not handle.done
                err = rel_err(manager.run_batch(batch), expected)
                if err >= TOL:
                    wrong.append(f"step {served} ({tokens} tokens): {err:.2e}")
                served += 1
        _finish(handle)
        stream.synchronize()
    assert during > 0, "no step was served while the capture ran"
    assert wrong == [], f"{len(wrong)} of {served} steps wrong: {wrong[:5]}"
    stats = manager.stats
    assert set(stats.eager_reasons) <= {"not_captured", "above_largest_size"}, stats.eager_reasons


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_the_last_outputs_survive_a_background_capture(mode: CUDAGraphMode) -> None:
    for trial in range(3):
        model, twin, manager = _build(mode)
        _capture_until(manager, model, failing=32)  # 128 and 64 captured
        with _serving() as stream:
            batch = make_batch(100, 7, torch.device("cuda"), seed=10 + trial)
            expected = twin.eager(batch)
            out = manager.run_batch(batch)  # held, no further run()
            handle = manager.start_capture()  # captures 32 .. 1 into the pool, largest first
            _finish(handle)
            torch.cuda.synchronize()  # done: whatever the capture queued on any stream ran before the read
            err = rel_err(out, expected)  # read late, on the serving stream
            stream.synchronize()
        assert manager.num_captured == sum(len(keys) for _, keys in manager.dispatcher.capture_plan())
        assert err < TOL, f"trial {trial}: the held output changed during the capture ({err:.2e})"


# ---------------------------------------------------------------------------
# The stress test
# ---------------------------------------------------------------------------


def _stress(mode: CUDAGraphMode, steps: int, seed: int) -> dict[str, int]:
    """``steps`` random steps among random starts, clears and failing captures; every step checked.

    A step's outputs are held and checked again just before the next step
    (after whatever ran in between); a step sometimes waits behind a long
    kernel and reads inputs that kernel's stream produced after it.
    """
    model, twin, manager = _build(mode)
    rng = random.Random(seed)
    device = torch.device("cuda")
    counts = {"steps": 0, "wrong": 0, "starts": 0, "clears": 0, "failed_captures": 0, "late_reads": 0}
    handle: BackgroundCapture | None = None
    held: tuple[torch.Tensor, torch.Tensor, int] | None = None  # output, expected, step
    failures: list[str] = []

    def check(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        err = rel_err(out, expected)
        if err >= TOL:
            counts["wrong"] += 1
            failures.append(f"{what}: {err:.2e}")

    with _serving(), contextlib.ExitStack() as cleanup:
        cleanup.callback(lambda: handle is None or handle.wait(WAIT_S))  # a failed run leaves no thread
        while counts["steps"] < steps:
            idle = handle is None or handle.done
            action = rng.random()
            if action < 0.04 and idle:
                if rng.random() < 0.5:
                    torch._C._cuda_sleep(LONG_CYCLES // 10)  # queued work the warm-ups must wait for
                if rng.random() < 0.3:
                    model.fail_recording_at = {rng.choice(SIZES)}  # one key fails in the background
                handle = manager.start_capture()
                counts["starts"] += 1
            elif action < 0.06 and idle:
                manager.clear()
                counts["clears"] += 1
            elif action < 0.08 and idle:
                model.fail_recording_at = {rng.choice(SIZES)}
                with contextlib.suppress(CaptureError):
                    manager.capture(progress=False)
                model.fail_recording_at = set()
                counts["failed_captures"] += 1
            if handle is not None and handle.done:
                model.fail_recording_at = set()
            if held is not None:  # read late: after whatever ran since that step
                check(held[0], held[1], f"step {held[2]}, read late")
                counts["late_reads"] += 1
                held = None
            tokens = rng.randint(1, max(SIZES) + 8)
            reqs = min(tokens, rng.randint(1, MAX_NUM_SEQS))
            if rng.random() < 0.1:
                torch._C._cuda_sleep(LONG_CYCLES // 20)  # the inputs below are produced behind it
            batch = {k: v.clone() for k, v in make_batch(tokens, reqs, device, seed=counts["steps"]).items()}
            expected = twin.eager(batch)
            if rng.random() < 0.2:
                time.sleep(rng.random() * 2e-4)  # a host gap: the capture thread gets the GIL
            out = manager.run_batch(batch)
            if rng.random() < 0.3:
                held = (out, expected, counts["steps"])
            else:
                check(out, expected, f"step {counts['steps']} ({tokens} tokens)")
            counts["steps"] += 1
        if handle is not None:
            handle.wait(WAIT_S)
        if held is not None:
            check(held[0], held[1], f"step {held[2]}, read late")
    assert failures == [], f"{counts['wrong']} wrong of {counts['steps']}: {failures[:5]}"
    stats = manager.stats
    counts["replays"] = stats.num_replays
    counts["eager"] = stats.eager_steps
    return counts


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_random_interleavings_never_corrupt_a_step(mode: CUDAGraphMode) -> None:
    counts = _stress(mode, STRESS_STEPS, seed=list(CUDAGraphMode).index(mode))
    print(f"stress {mode.name}: {counts}")  # the counts go into the GPU run's log
    assert counts["wrong"] == 0
    for what in ("starts", "clears", "failed_captures", "late_reads", "replays", "eager"):
        assert counts[what] > 0, f"the stress test never did {what}: {counts}"


def test_two_managers_capture_on_one_device_at_once() -> None:
    """Two background captures and a foreground one on one device take turns on its capture stream."""
    (model_a, twin_a, manager_a), (_, twin_b, manager_b) = (
        _build(CUDAGraphMode.FULL),
        _build(CUDAGraphMode.PIECEWISE),
    )
    _, twin_c, manager_c = _build(CUDAGraphMode.FULL_AND_PIECEWISE)
    rng = random.Random(7)
    served = 0
    with _serving() as stream, _waited([manager_a.start_capture(), manager_b.start_capture()]) as handles:
        report = manager_c.capture(progress=False)  # in the foreground, while both record
        assert report.num_graphs == sum(len(keys) for _, keys in manager_c.dispatcher.capture_plan())
        while not all(h.done for h in handles) or served < 60:
            for manager, twin in ((manager_a, twin_a), (manager_b, twin_b), (manager_c, twin_c)):
                tokens = rng.randint(1, max(SIZES))
                batch = make_batch(tokens, min(tokens, 4), torch.device("cuda"), seed=served)
                err = rel_err(manager.run_batch(batch), twin.eager(batch))
                assert err < TOL, f"step {served} ({tokens} tokens) of a manager: {err:.2e}"
                served += 1
        for handle in handles:
            _finish(handle)
        stream.synchronize()
    assert model_a.scratch.isfinite().all()
    for manager in (manager_a, manager_b):
        assert manager.num_captured == sum(len(keys) for _, keys in manager.dispatcher.capture_plan())
