"""Faults during ``CUDAGraphManager.capture()``: the model raises, CUDA runs out of memory, Ctrl-C.

Each case makes one key of the capture plan fail while it is being captured
(only then: the warm-up and eager steps of that size run fine) and checks the
manager afterwards:

- the error names the key that failed;
- the keys captured before the fault replay correctly, the failed key and the
  ones after it run eagerly (counted as ``not_captured``), and a second
  ``capture()`` captures exactly the rest, after which every size replays;
- nothing leaked into the graph pool: the manager captures into a pool of its
  own, whose segments are measured against a clean capture of the same plan
  into another pool of its own, after the recovery and again after
  ``clear()`` and a full capture.

GPU only: each case is about what the real engines, CUDA and the caching
allocator do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Final

import pytest
import torch
from torch import nn
from torch.nn.functional import linear

from cudagraph_capture import CaptureError, CaptureOptions, eager_break_during_capture
from cudagraph_capture._pool import GraphPool
from cudagraph_dispatch import BatchDescriptor, CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput
from tests.torch_support import as_tensor, highest_fp32_matmul_precision, rel_err

pytestmark = pytest.mark.gpu

FULL: Final = CUDAGraphMode.FULL
PIECEWISE: Final = CUDAGraphMode.PIECEWISE

#: Model width and hidden width: the hidden activation is 16 KiB per token
#: (4 MiB at 256 tokens), so a capture's pool memory is several MiB per size.
DIM: Final = 256
HIDDEN: Final = 4096
#: Captured largest first: 256, 192, 128, 64, 32. Each size minus one pads to it.
SIZES: Final = (32, 64, 128, 192, 256)
INPUTS: Final = {"x": StaticInput((DIM,), torch.float32, "tokens", pad_value=0.0)}
#: Where in the capture order the fault hits.
POSITIONS: Final = {"first": 0, "middle": 2, "last": len(SIZES) - 1}
#: Replay against eager on the same fp32 data: a padded batch may run another kernel.
TOL: Final = 1e-4
#: A recovered capture may use at most this much more pool memory than a clean one.
POOL_SLACK: Final = 0.01
MIB: Final = 2**20


class ModelFaultError(Exception):
    """What the model raises while one size is being captured."""


def _raise_model_fault() -> None:
    raise ModelFaultError("the model failed while capturing")


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@eager_break_during_capture
def _halve_(h: torch.Tensor) -> None:
    """The model's eager break: a PIECEWISE capture ends a graph segment here."""
    h.mul_(0.5)


class FaultyMLP(nn.Module):
    """``x + W2 halve(relu(W1 x))``, row-wise; ``fault`` runs while ``fault_at`` tokens are captured.

    The fault comes after the eager break and after the hidden activation was
    allocated: a FULL capture has pool memory in use when it fails, a
    PIECEWISE capture has captured (and run) a segment already.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(HIDDEN, DIM, device=device) / math.sqrt(DIM), requires_grad=False)
        self.w2 = nn.Parameter(
            torch.randn(DIM, HIDDEN, device=device) / math.sqrt(HIDDEN), requires_grad=False
        )
        self.fault_at: int | None = None
        self.fault: Callable[[], object] = _raise_model_fault
        self.faults = 0  # how often the fault ran: the test proves nothing if it never did

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, DIM] -> [T, DIM]
        h = torch.relu(linear(x, self.w1))  # [T, HIDDEN]
        _halve_(h)
        if self.fault_at == x.shape[0] and torch.cuda.is_current_stream_capturing():
            self.faults += 1
            self.fault()
        return x + linear(h, self.w2)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: a plain call on the real rows (no manager, no padding)."""
        with torch.no_grad():
            return as_tensor(self(x))


@dataclasses.dataclass(frozen=True, slots=True)
class PoolUsage:
    """Bytes of a graph pool's device segments: reserved, and allocated to live tensors."""

    reserved: int
    allocated: int


class PinnedPool:
    """A graph pool of the test's own, pinned by a one-kernel graph that lives as long as this object.

    A handle from ``torch.cuda.graph_pool_handle()`` stops being usable for
    captures once every graph captured into it is freed (as after a failed
    first capture): the anchor keeps it usable, as the shared pool's anchor
    does. Its segments hold exactly what the captures into it allocated.
    """

    def __init__(self) -> None:
        self.handle: Final[GraphPool] = torch.cuda.graph_pool_handle()
        self._scratch = torch.zeros(1, device="cuda")  # [1], outside the pool
        self._anchor = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._anchor, pool=self.handle):
            self._scratch.add_(1)

    def usage(self) -> PoolUsage:
        torch.cuda.synchronize()
        wanted = tuple(self.handle)
        segments = [
            segment
            for segment in torch.cuda.memory._snapshot()["segments"]
            if tuple(segment.get("segment_pool_id", ())) == wanted
        ]
        return PoolUsage(
            reserved=sum(int(s["total_size"]) for s in segments),
            allocated=sum(int(s["allocated_size"]) for s in segments),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """What a failed ``capture()`` raised, without keeping the exception (its frames hold tensors)."""

    kind: type[BaseException]
    message: str
    descriptor: BatchDescriptor | None
    cause: type[BaseException] | None
    notes: tuple[str, ...]


@pytest.fixture(autouse=True)
def _exact_fp32() -> Iterator[None]:
    torch.manual_seed(0)
    with highest_fp32_matmul_precision():
        yield


def _config(mode: CUDAGraphMode) -> DispatchConfig:
    return DispatchConfig(mode, CaptureSizes(SIZES), max_num_seqs=max(SIZES))


def _manager(model: FaultyMLP, mode: CUDAGraphMode, pool: PinnedPool) -> CUDAGraphManager[torch.Tensor]:
    return CUDAGraphManager(
        model, INPUTS, _config(mode), options=ManagerOptions(capture=CaptureOptions(pool=pool.handle))
    )


def _plan(manager: CUDAGraphManager[torch.Tensor]) -> list[BatchDescriptor]:
    """The keys in capture order (the dispatcher is the one source of truth for them)."""
    return [key for _, keys in manager.dispatcher.capture_plan() for key in keys]


def _check_steps(
    manager: CUDAGraphManager[torch.Tensor], model: FaultyMLP, mode: CUDAGraphMode, captured: int
) -> None:
    """Run every size, exact and padded, on fresh random inputs; outputs equal eager.

    The first ``captured`` keys of the plan replay, the others run eagerly:
    ``stats`` must say so, step by step.
    """
    plan = _plan(manager)
    manager.reset_stats()
    for index, key in enumerate(plan):
        for n in (key.num_tokens, key.num_tokens - 1):
            x = torch.randn(n, DIM, device="cuda")
            expected = model.eager(x)
            out = manager.run(x=x)
            err = rel_err(out, expected)
            assert err < TOL, f"{n} tokens ({key}): output differs from eager, rel err {err:.3e}"
        stats = manager.stats
        if index < captured:
            assert stats.replays.get((mode, key.num_tokens)) == 2, f"{key} did not replay: {stats}"
        else:
            assert (mode, key.num_tokens) not in stats.replays, f"{key} replayed a graph: {stats}"
    stats = manager.stats
    eager = 2 * (len(plan) - captured)
    assert dict(stats.eager_reasons) == ({"not_captured": eager} if eager else {}), stats
    assert stats.eager_steps == stats.uncaptured_steps == eager
    assert stats.num_replays == 2 * captured


def _clean_usage(model: FaultyMLP, mode: CUDAGraphMode) -> PoolUsage:
    """A clean capture of the plan into a pool of its own: what the recovered manager may use."""
    pool = PinnedPool()
    clean = _manager(model, mode, pool)
    report = clean.capture(progress=False)
    assert report.num_graphs == len(SIZES)
    _check_steps(clean, model, mode, captured=len(SIZES))
    usage = pool.usage()
    # The largest size alone allocates a 4 MiB hidden activation: the measurement saw the pool.
    assert usage.reserved >= 4 * MIB, f"clean capture reserved only {usage.reserved} bytes in its pool"
    return usage


def _failing_capture(manager: CUDAGraphManager[torch.Tensor], expected: type[BaseException]) -> Failure:
    """Run ``capture()``, which must raise ``expected``; return what it raised, dropping the exception."""
    with pytest.raises(expected) as caught:
        manager.capture(progress=False)
    error = caught.value
    failure = Failure(
        kind=type(error),
        message=str(error),
        descriptor=error.descriptor if isinstance(error, CaptureError) else None,
        cause=None if error.__cause__ is None else type(error.__cause__),
        notes=tuple(getattr(error, "__notes__", ())),
    )
    # The traceback holds the failed capture's frames and their pool tensors: drop it
    # here, so that what the pool holds afterwards is what the manager kept.
    del error, caught
    return failure


def _fault_then_recover(
    mode: CUDAGraphMode,
    position: str,
    fault: Callable[[], object],
    expected: type[BaseException],
    during_capture: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
) -> tuple[Failure, BatchDescriptor]:
    """Fail the capture of the key at ``position``, check the recovery; return the failure and the key."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = FaultyMLP(device)
    clean = _clean_usage(model, mode)

    pool = PinnedPool()
    manager = _manager(model, mode, pool)
    plan = _plan(manager)
    assert [key.num_tokens for key in plan] == sorted(SIZES, reverse=True)
    failed_index = POSITIONS[position]
    failing = plan[failed_index]
    model.fault_at, model.fault = failing.num_tokens, fault
    with during_capture():
        failure = _failing_capture(manager, expected)
    assert model.faults == 1, f"the fault ran {model.faults} times, expected once (at {failing})"
    model.fault_at = None

    # Usable: the keys before the fault replay, the failed one and the rest run eagerly.
    assert manager.num_captured == failed_index
    after_fault = pool.usage()
    assert after_fault.allocated <= clean.allocated, (
        f"after the failed capture of {failing}, {after_fault.allocated} bytes of the pool are still "
        f"allocated (a clean capture leaves {clean.allocated}): the failed capture's tensors leaked"
    )
    _check_steps(manager, model, mode, captured=failed_index)

    # A second capture() captures exactly the rest; then every size replays.
    report = manager.capture(progress=False)
    assert [graph.descriptor for graph in report.graphs] == plan[failed_index:]
    assert manager.num_captured == len(plan)
    _check_steps(manager, model, mode, captured=len(plan))
    _assert_no_more_than(pool.usage(), clean, "after the recovery")

    # A later full capture into the same pool needs no more than a clean one either.
    manager.clear()
    assert manager.num_captured == 0
    report = manager.capture(progress=False)
    assert report.num_graphs == len(plan)
    _check_steps(manager, model, mode, captured=len(plan))
    _assert_no_more_than(pool.usage(), clean, "after clear() and a full capture")
    return failure, failing


def _assert_no_more_than(usage: PoolUsage, clean: PoolUsage, when: str) -> None:
    limit = clean.reserved * (1 + POOL_SLACK)
    assert usage.reserved <= limit, (
        f"{when}: the pool reserves {usage.reserved / MIB:.1f} MiB, a clean capture of the same plan "
        f"{clean.reserved / MIB:.1f} MiB: the failed capture leaked pool memory"
    )
    assert usage.allocated <= clean.allocated, (
        f"{when}: {usage.allocated} bytes of the pool allocated, a clean capture leaves {clean.allocated}"
    )


def _assert_names(failure: Failure, descriptor: BatchDescriptor) -> None:
    assert failure.kind is CaptureError, f"expected a CaptureError, got {failure.kind.__name__}"
    assert failure.descriptor == descriptor
    assert str(descriptor) in failure.message, failure.message


# ---------------------------------------------------------------------------
# The model raises
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position", list(POSITIONS))
def test_model_error_during_capture(position: str) -> None:
    """The model raising while one size is captured: CaptureError naming it, then a full recovery."""
    failure, failing = _fault_then_recover(FULL, position, _raise_model_fault, CaptureError)
    assert failing.num_tokens == sorted(SIZES, reverse=True)[POSITIONS[position]]
    _assert_names(failure, failing)
    assert failure.cause is ModelFaultError
    assert "ModelFaultError: the model failed while capturing" in failure.message


def test_model_error_during_breakable_capture() -> None:
    """PIECEWISE (the breakable engine), the fault after a segment was captured: the same recovery."""
    failure, failing = _fault_then_recover(PIECEWISE, "middle", _raise_model_fault, CaptureError)
    assert failing == BatchDescriptor(128)  # PIECEWISE keys are relaxed
    _assert_names(failure, failing)
    assert failure.cause is ModelFaultError


# ---------------------------------------------------------------------------
# CUDA runs out of memory
# ---------------------------------------------------------------------------


class _OutOfMemory:
    """Caps the process's device memory a little above what it holds; the fault allocates above the cap."""

    def __init__(self) -> None:
        device = torch.cuda.current_device()
        self.device: Final = device
        total = torch.cuda.get_device_properties(device).total_memory
        # What may be reserved under the cap: today's reservations plus room for the capture itself.
        allowed = torch.cuda.memory_reserved(device) + 1024 * MIB
        self.fraction: Final = allowed / total
        # More than the cap allows, but less than the device has: only the cap makes it fail.
        self.nbytes: Final = allowed + 1024 * MIB
        assert self.nbytes < total, "the device is too small for this test"

    def allocate(self) -> None:
        torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")

    @contextlib.contextmanager
    def capped(self) -> Iterator[None]:
        previous = torch.cuda.get_per_process_memory_fraction(self.device)
        torch.cuda.set_per_process_memory_fraction(self.fraction, self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, self.device)


def test_out_of_memory_during_capture() -> None:
    """An allocation over the memory cap while one size is captured: CaptureError from OutOfMemoryError."""
    oom = _OutOfMemory()
    previous = torch.cuda.get_per_process_memory_fraction(oom.device)
    failure, failing = _fault_then_recover(FULL, "middle", oom.allocate, CaptureError, oom.capped)
    assert torch.cuda.get_per_process_memory_fraction(oom.device) == previous  # the cap was lifted
    _assert_names(failure, failing)
    assert failure.cause is torch.OutOfMemoryError
    assert "OutOfMemoryError" in failure.message


# ---------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------


def test_keyboard_interrupt_during_capture_leaves_the_manager_usable() -> None:
    """KeyboardInterrupt while one size is captured propagates as itself; the manager then recovers."""
    failure, _ = _fault_then_recover(FULL, "middle", _raise_keyboard_interrupt, KeyboardInterrupt)
    assert failure.kind is KeyboardInterrupt  # never wrapped: Ctrl-C must stay Ctrl-C


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) need Python 3.11")
def test_keyboard_interrupt_during_capture_carries_a_note_naming_the_key() -> None:
    """The interrupt is not wrapped in a CaptureError, so a note must say which key was being captured.

    Out of a loop over the whole plan, a bare interrupt does not say which size
    it stopped: the engine that was capturing must add the note (Python 3.11+).
    """
    model = FaultyMLP(torch.device("cuda", torch.cuda.current_device()))
    pool = PinnedPool()
    manager = _manager(model, FULL, pool)
    failing = _plan(manager)[POSITIONS["middle"]]
    model.fault_at, model.fault = failing.num_tokens, _raise_keyboard_interrupt
    failure = _failing_capture(manager, KeyboardInterrupt)
    assert model.faults == 1
    assert failure.kind is KeyboardInterrupt
    pattern = re.compile(rf"num_tokens={failing.num_tokens}\b")
    assert any(pattern.search(note) for note in failure.notes), (
        f"no note names the key being captured ({failing}); notes: {list(failure.notes)}"
    )
