"""Capture in a thread beside the serving steps: graphs switch in as they become ready.

``CUDAGraphManager.start_capture()`` returns at once with a ``BackgroundCapture``
handle. A daemon thread captures the plan's keys one at a time while ``run()``
keeps serving: a step whose key is not captured yet runs eagerly (counted as
``not_captured``), and a key replays from the first step after its capture was
finished and checked.

Two threads share one pool and one set of static buffers, so they take turns
where they touch them. A key's capture (filling the buffers with pad values,
the warm-up, the recording, and the runs of a breakable capture's segments)
holds the manager's replay lock and runs on a stream of its own that first
waits for the serving stream; a replay takes the same lock if it is free
(never waiting for it: a step whose graph is ready while a capture holds the
buffers runs eagerly, counted as ``capture_running``) and makes its stream
wait for the capture stream. Eager steps take no lock: they read the caller's
tensors, not the buffers. What the serving thread must not do during
a background capture: synchronize the whole device (``torch.cuda.synchronize()``),
use the legacy default stream, or draw from the default CUDA generator (the
capture has registered it): each fails or invalidates the capture in
flight. An invalidated capture is dropped and the key tried again (up to
``RETRIES`` more times); an error is kept on the handle and logged, and the
other keys go on.

Order: keys that recent steps needed first (most recent miss first), then
the rest largest first, so the pool's smaller graphs reuse the memory of the
larger ones.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

import torch

from cudagraph_capture import collector_paused
from cudagraph_dispatch import BatchDescriptor

from ._compiled import compiles_since, dynamo_compiles
from ._report import CapturedGraph, CaptureReport

_logger: Final = logging.getLogger("cudagraph_manager")

#: More tries of a key whose capture failed (a device-wide sync on another thread
#: invalidates a capture; a model error fails every try).
RETRIES: Final = 2
#: Keys recent steps ran eagerly for, remembered to capture them first.
MISSES_KEPT: Final = 64


class BackgroundCapture:
    """A capture running beside the serving steps: progress, errors, and its report when done.

    ``done`` says whether the thread finished; ``progress`` is ``(keys
    finished, keys planned)`` (captured or given up on); ``errors`` holds the
    error of each key given up on; ``retries`` counts failed tries that were
    tried again; ``wait(timeout)`` blocks until done and returns the report
    (``TimeoutError`` if the timeout passes first).
    """

    __slots__ = ("_done", "_errors", "_finished", "_lock", "_records", "_report", "_retries", "_total")

    def __init__(self, total: int) -> None:
        self._total: Final = total
        self._lock: Final = threading.Lock()
        self._done: Final = threading.Event()
        self._records: list[CapturedGraph] = []
        self._errors: list[BaseException] = []
        self._finished = 0
        self._retries = 0
        self._report: CaptureReport | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def progress(self) -> tuple[int, int]:
        with self._lock:
            return self._finished, self._total

    @property
    def errors(self) -> tuple[BaseException, ...]:
        with self._lock:
            return tuple(self._errors)

    @property
    def retries(self) -> int:
        return self._retries

    def wait(self, timeout: float | None = None) -> CaptureReport:
        """The report, once the capture finished; ``TimeoutError`` if ``timeout`` seconds pass first."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background capture is not done after {timeout} s ({self.progress})")
        assert self._report is not None
        return self._report

    def _captured(self, record: CapturedGraph) -> None:
        with self._lock:
            self._records.append(record)
            self._finished += 1

    def _gave_up(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)
            self._finished += 1

    def _finish(self, seconds: float, reserved_bytes: int, compiles: int | None = None) -> None:
        with self._lock:
            self._report = CaptureReport(tuple(self._records), seconds, reserved_bytes, compiles=compiles)
        self._done.set()


class Misses:
    """The keys recent steps ran eagerly for because they were not captured yet (thread-safe)."""

    __slots__ = ("_keys", "_lock")

    def __init__(self) -> None:
        self._lock: Final = threading.Lock()
        self._keys: collections.deque[BatchDescriptor] = collections.deque(maxlen=MISSES_KEPT)

    def add(self, key: BatchDescriptor) -> None:
        with self._lock:
            self._keys.append(key)

    def most_recent(self, pending: Sequence[BatchDescriptor]) -> BatchDescriptor | None:
        """The most recently missed key still in ``pending``, or ``None``."""
        with self._lock:
            missed = list(self._keys)
        waiting = set(pending)
        return next((key for key in reversed(missed) if key in waiting), None)


def capture_loop(
    handle: BackgroundCapture,
    pending: list[BatchDescriptor],
    misses: Misses,
    capture_one: Callable[[BatchDescriptor], CapturedGraph],
    device: torch.device,
    gc_disable: bool,
    finished: Callable[[], None],
) -> None:
    """The thread's body: capture ``pending`` (largest first) with recent misses moved ahead.

    ``capture_one`` captures one key in turn with the serving thread (the
    manager's replay lock and streams); ``finished`` hands the replays their
    lock-free path back. Never raises: errors go to the handle and the log.
    """
    start = time.perf_counter()
    compiled_before = dynamo_compiles()
    cuda = device.type == "cuda"
    reserved_before = torch.cuda.memory_reserved(device) if cuda else 0
    try:
        on_device = torch.cuda.device(device) if cuda else contextlib.nullcontext()
        with collector_paused(gc_disable), torch.no_grad(), on_device:
            while pending:
                key = misses.most_recent(pending) or pending[0]
                pending.remove(key)
                _capture_with_retries(handle, key, capture_one)
    except BaseException as error:  # the step loop must never stop: report, never raise
        _logger.exception("background capture stopped")
        handle._gave_up(error)
    finally:
        finished()
        reserved = torch.cuda.memory_reserved(device) - reserved_before if cuda else 0
        handle._finish(time.perf_counter() - start, reserved, compiles_since(compiled_before))


def _capture_with_retries(
    handle: BackgroundCapture, key: BatchDescriptor, capture_one: Callable[[BatchDescriptor], CapturedGraph]
) -> None:
    for attempt in range(RETRIES + 1):
        try:
            handle._captured(capture_one(key))
            return
        except Exception as error:  # a model's error, an invalidated capture: never the whole loop
            if attempt < RETRIES:
                handle._retries += 1
                _logger.warning("background capture of %s failed, trying again: %s", key, error)
                continue
            _logger.error("background capture gave up on %s: %s", key, error)
            handle._gave_up(error)
