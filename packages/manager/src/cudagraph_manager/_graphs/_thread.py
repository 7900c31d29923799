"""Capture in a thread beside the serving steps: graphs switch in as they become ready.

``CUDAGraphManager.start_capture()`` returns a ``ThreadCapture`` without
ranks (a ``BackgroundCapture`` handle): one object that owns everything the
capture needs (its stream, the event that orders its warm-ups with the
serving stream, the keys steps missed, its retries, its garbage-collection
policy) and reports on it. How it stays out of the serving steps' way, and
what the serving thread must not do meanwhile: docs/design.md,
"Background capture".

It runs on the device's capture worker (``CaptureWorker``), a thread that
outlives the sessions: library handles and plans belong to a thread (cuDNN
builds an attention plan per shape, slowly, the first time), so a session on
a new thread would pay them again for every size. The worker runs a device's
sessions one after another and keeps that state between them; a session
that finds it busy runs on a thread of its own. The worker stops once no
manager that used it is alive, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Final, Protocol

import torch

from cudagraph_capture._gc import collector_paused
from cudagraph_capture._pool import capture_stream
from cudagraph_dispatch import BatchDescriptor

from .._memory._device import CaptureTotals, capture_lock_of, on_device
from .._values._reports import CapturedGraph, CaptureReport
from ._recording import RETRIES, worth_retrying
from ._warm_up import WarmUps

_logger: Final = logging.getLogger("cudagraph_manager")

#: Keys recent steps ran eagerly for, remembered to capture them first.
MISSES_KEPT: Final = 64


def check_keys_per_step(keys_per_step: object, ranks: bool) -> None:
    """``start_capture``'s ``keys_per_step``: an int >= 1, for a manager with ranks (``ValueError``)."""
    if not isinstance(keys_per_step, int) or isinstance(keys_per_step, bool) or keys_per_step < 1:
        raise ValueError(f"keys_per_step: expected an int >= 1, got {keys_per_step!r:.60}")
    if keys_per_step != 1 and not ranks:
        raise ValueError(
            f"keys_per_step: the keys a step captures, with ranks (ManagerOptions.ranks); without "
            f"ranks a background capture runs in a thread, not in the steps; got {keys_per_step!r}"
        )


class ThreadJobs(Protocol):
    """What a capture thread asks of its manager's captures (``Capturer``): its one seam (its jobs).

    ``device`` and ``gc_disable`` say where and how it captures;
    ``start_totals`` starts a phase's measurements and ``report`` ends them
    (the manager adds why it captures nothing, if it does); ``warm_up`` runs
    one key eagerly, skipped where ``skippable`` and the thread has its
    handles (the warm-up rule's); ``capture`` records a key warmed up before.
    The capture worker keeps a weak reference to it (its owner, alive while
    it is), so an implementation has ``__weakref__``.
    """

    @property
    def device(self) -> torch.device: ...

    @property
    def gc_disable(self) -> bool: ...

    def start_totals(self) -> CaptureTotals: ...

    def report(
        self, totals: CaptureTotals, graphs: Sequence[CapturedGraph], why: str | None
    ) -> CaptureReport: ...

    def warm_up(self, descriptor: BatchDescriptor, *, skippable: bool) -> None: ...

    def capture(self, descriptor: BatchDescriptor) -> CapturedGraph: ...


@dataclasses.dataclass(frozen=True, slots=True)
class BackgroundTimings:
    """How long a background capture's first recording waits for the first step, in seconds.

    Args:
        first_step_wait_s: for the serving thread's first step after
            ``start_capture()`` (the wake's first step then runs alone on the
            host: an eager step plus the enqueue).
        first_outputs_wait_s: then for that step's device work (its outputs
            ready), polled (never synchronized: ``stop()`` ends the wait).
        first_outputs_grace_s: and after it (the serving thread, woken by the
            same completion, reads the outputs without the recording's share
            of the GIL).
        poll_s: the interval of that polling.

    One per ``Capturer`` (``background_timings``); tests give their own.
    """

    first_step_wait_s: float = 0.05
    first_outputs_wait_s: float = 1.0
    first_outputs_grace_s: float = 0.001
    poll_s: float = 0.0005


class FirstStep:
    """The serving thread's first step after ``start_capture()``, which the first recording waits for.

    ``served()`` (the step is queued), ``unblock()`` (``wait()``, ``stop()``)
    or the wait's own bound ends the wait for the step; after ``served()``,
    its device work is waited for too (polled, so ``stop()`` ends it).
    """

    __slots__ = ("_event", "_outputs")

    def __init__(self) -> None:
        self._event: Final = threading.Event()
        self._outputs: torch.cuda.Event | None = None  # recorded after the first step's work

    def unblock(self) -> None:
        self._event.set()

    def served(self, device: torch.device) -> None:
        """The first step is queued on ``device``'s current stream. Never raises (a step's ``finally``)."""
        if self._event.is_set():  # every later step: nothing to do
            return
        try:
            if device.type == "cuda":
                outputs = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                outputs.record(torch.cuda.current_stream(device))  # the session's device's stream
                self._outputs = outputs  # before the flag: the worker reads it after the flag
        except Exception:  # a sticky CUDA error of the step itself, most likely: the step reports it
            _logger.debug("background capture: no event after the first step", exc_info=True)
        finally:
            self._event.set()

    def wait(self, timings: BackgroundTimings, stop: threading.Event) -> None:
        """Until the first step is served and its outputs are ready, or the bounds pass; holds no lock."""
        self._event.wait(timings.first_step_wait_s)
        self._event.set()  # waited once: a later step makes no event
        outputs = self._outputs
        if outputs is None:
            return
        deadline = time.monotonic() + timings.first_outputs_wait_s
        while not stop.is_set() and time.monotonic() < deadline:
            if outputs.query():  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                time.sleep(timings.first_outputs_grace_s)
                return
            time.sleep(timings.poll_s)  # polled, not synchronized: the wait stays bounded


class ThreadCapture:
    """A capture running in a thread beside the serving steps: progress, errors, and its report when done.

    ``done`` says whether the thread finished; ``progress`` is ``(keys
    finished, keys planned)`` (captured or given up on); ``errors`` holds the
    error of each key given up on (and of a failed warm-up); ``retries``
    counts failed tries that were tried again; ``wait(timeout)`` blocks until
    done and returns the report (``TimeoutError`` if the timeout passes first).
    """

    __slots__ = (
        "__weakref__",  # its manager's captures refer to it weakly (it refers to them)
        "_done",
        "_errors",
        "_finished",
        "_first",
        "_jobs",
        "_lock",
        "_misses",
        "_pending",
        "_records",
        "_report",
        "_retries",
        "_stop",
        "_thread",
        "_timings",
        "_total",
        "_warm_ups",
        "_warm_ups_queued",
    )

    def __init__(
        self,
        pending: Sequence[BatchDescriptor],
        warm_ups: WarmUps,
        jobs: ThreadJobs,
        *,
        timings: BackgroundTimings,
    ) -> None:
        self._pending: Final = list(pending)  # largest first; the capture thread's alone
        self._warm_ups: Final = warm_ups
        #: The manager's captures, which this session asks for warm-ups, recordings and its
        #: report; the capture worker lives while they do.
        self._jobs: Final = jobs
        self._timings: Final = timings
        self._total: Final = len(pending)
        self._lock: Final = threading.Lock()  # the counters and lists below, read by any thread
        self._first: Final = FirstStep()  # the first recording waits for it
        self._done: Final = threading.Event()
        self._warm_ups_queued: Final = threading.Event()  # on the device, not necessarily run
        self._stop: Final = threading.Event()  # stop(): record no further key
        self._misses: Final[collections.deque[BatchDescriptor]] = collections.deque(maxlen=MISSES_KEPT)
        self._records: list[CapturedGraph] = []
        self._errors: list[BaseException] = []
        self._finished = 0
        self._retries = 0
        self._report: CaptureReport | None = None
        self._thread = 0  # the capture thread's ident while it runs

    # -- the handle --

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
        with self._lock:
            return self._retries

    def wait(self, timeout: float | None = None) -> CaptureReport:
        """The report, once the capture finished.

        Args:
            timeout: seconds to wait at most (``None``: no bound).

        Returns:
            The capture's report.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            ValueError: ``timeout`` is no number of seconds >= 0.
            RuntimeError: called from the capture thread, inside the capture (the model).
        """
        given: object = timeout
        if given is not None and (
            isinstance(given, bool) or not isinstance(given, (int, float)) or not given >= 0
        ):
            raise ValueError(f"timeout: expected None or a number of seconds >= 0, got {timeout!r}")
        if threading.get_ident() == self._thread and not self._done.is_set():
            raise RuntimeError(
                "wait(): called from inside the background capture it waits for (the model, attention "
                "builder or decode loop's advance, on the capture thread); it would wait for itself"
            )
        self._first.unblock()  # the caller waits: the first recording need not wait for its step
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background capture is not done after {timeout} s ({self.progress})")
        assert self._report is not None
        return self._report

    def stop(self) -> None:
        """Record no further key (the one being recorded finishes); ``wait()`` then returns soon.

        The keys left are not captured; the report says so. ``release()``
        calls it. Any thread.
        """
        self._stop.set()
        self._first.unblock()

    # -- the serving thread's side --

    def missed(self, key: BatchDescriptor) -> None:
        """A step runs eagerly because ``key`` is not captured yet: capture it next; ``served()`` follows."""
        with self._lock:
            self._misses.append(key)

    def served(self) -> None:
        """The eager step ``missed()`` announced is over on the host (queued on the serving stream)."""
        self._first.served(self._jobs.device)

    def start(self) -> None:
        """Hand the capture to its thread; return once its warm-ups are queued, the stream ordered after them.

        Call from the serving thread, on the stream steps run on: the
        warm-ups wait on the device for what it queued so far, and it waits
        on the device for them. Never waits for the device itself.
        """
        device = self._jobs.device
        if not self._pending:
            self._finish(self._jobs.start_totals())
            self._done.set()
            return
        cuda = device.type == "cuda"
        serving = torch.cuda.current_stream(device) if cuda else None
        # The thread works on the capture stream: a stream of the engines' own, never one that
        # torch's stream pool could also hand the serving thread.
        own = capture_stream(device) if cuda else None
        if serving is not None and own is not None and serving.cuda_stream == own.cuda_stream:
            raise RuntimeError("start_capture: called on the capture stream; call it on the serving stream")
        warm_ups_done = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]  # untyped stubs
        # The device's capture worker, whose handles and plans outlive this session (``CaptureWorker``).
        body = functools.partial(self._run, serving, own, warm_ups_done)
        run_capture(device, body, self._jobs, "cudagraph-background-capture", self._done.set)
        self._warm_ups_queued.wait()
        if serving is not None and warm_ups_done is not None:
            serving.wait_event(warm_ups_done)  # the next step runs after the warm-ups, on the device

    # -- the capture thread --

    def _run(
        self,
        serving: torch.cuda.Stream | None,
        own: torch.cuda.Stream | None,
        warm_ups_done: torch.cuda.Event | None,
    ) -> None:
        """The thread's body: warm up, then record every pending key. Never raises."""
        self._thread = threading.get_ident()
        jobs = self._jobs
        totals = jobs.start_totals()
        on_stream = torch.cuda.stream(own) if own is not None else contextlib.nullcontext()
        try:
            with on_device(jobs.device), on_stream, torch.no_grad():
                self._warm_up(serving, own, warm_ups_done)
                self._first.wait(self._timings, self._stop)
                while self._pending and not self._stop.is_set():
                    key = self._next_key()
                    with capture_lock_of(jobs.device), collector_paused(jobs.gc_disable):  # one key at a time
                        if serving is not None and own is not None:
                            own.wait_stream(serving)  # this turn after what the serving stream queued so far
                        self._capture_with_retries(key)
        except BaseException as error:  # the step loop must never stop: report, never raise
            _logger.exception("background capture stopped")
            self._gave_up(error)
        finally:
            self._warm_ups_queued.set()  # never leave start() waiting
            self._finish(totals)

    def _warm_up(
        self,
        serving: torch.cuda.Stream | None,
        own: torch.cuda.Stream | None,
        warm_ups_done: torch.cuda.Event | None,
    ) -> None:
        try:
            with capture_lock_of(self._jobs.device):
                if serving is not None and own is not None:
                    own.wait_stream(serving)  # everything the serving stream queued before start_capture()
                warm_ups = self._warm_ups
                for key in warm_ups.keys:
                    self._jobs.warm_up(key, skippable=key in warm_ups.skippable)
        except Exception as error:  # the captures will say which keys fail; keep going
            _logger.exception("background capture: a warm-up failed")
            with self._lock:
                self._errors.append(error)
        finally:
            if own is not None and warm_ups_done is not None:
                warm_ups_done.record(own)
            self._warm_ups_queued.set()

    def _next_key(self) -> BatchDescriptor:
        """The most recently missed pending key, else the largest pending one."""
        with self._lock:
            missed = list(self._misses)
        waiting = set(self._pending)
        chosen = next((key for key in reversed(missed) if key in waiting), self._pending[0])
        self._pending.remove(chosen)
        return chosen

    def _capture_with_retries(self, key: BatchDescriptor) -> None:
        for attempt in range(RETRIES + 1):
            try:
                record = self._jobs.capture(key)
            except Exception as error:  # a model's error, an invalidated capture: never the whole loop
                if attempt < RETRIES and worth_retrying(error):
                    with self._lock:
                        self._retries += 1
                    _logger.warning("background capture of %s failed, trying again: %s", key, error)
                    continue
                _logger.error("background capture gave up on %s: %s", key, error)
                self._gave_up(error)
                return
            with self._lock:
                self._records.append(record)
                self._finished += 1
            return

    def _gave_up(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)
            self._finished += 1

    def _finish(self, totals: CaptureTotals) -> None:
        with self._lock:
            why = None
            if self._pending:
                why = f"stopped (stop() or release()) with {len(self._pending)} of {self._total} keys left"
            self._report = self._jobs.report(totals, self._records, why)
        # ``done`` is set by the thread's runner once it is free again (``run_capture``).


# -- the device's capture worker --

_JOIN_AT_EXIT_S: Final = 5.0

#: What the worker runs: a session's body, then what follows it once the worker is free.
Task = Callable[[], None]


class CaptureWorker:
    """A daemon thread that runs capture tasks one at a time (``try_run``) until ``stop``."""

    __slots__ = ("_busy", "_lock", "_stopped", "_tasks", "_thread", "_users")

    def __init__(self, name: str) -> None:
        self._tasks: Final[queue.SimpleQueue[tuple[Task, Task] | None]] = queue.SimpleQueue()
        # _busy, _stopped, _users; reentrant: a user's finalizer may run inside try_run (a GC there).
        self._lock: Final = threading.RLock()
        self._busy = False
        self._stopped = False
        #: The owners (a manager's ``Capturer``) that used the worker; it stops when none is alive.
        self._users: Final[weakref.WeakSet[object]] = weakref.WeakSet()
        self._thread: Final = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def alive(self) -> bool:
        with self._lock:
            return not self._stopped and self._thread.is_alive()

    def try_run(self, task: Task, user: object, after: Task) -> bool:
        """Queue ``task`` and return ``True``, unless the worker is busy or stopped (``False``).

        ``after`` runs on the worker once the task is done and the worker is
        free again. All under the lock: the queue's order always matches the
        flags, even where a finalizer runs in here (a collection) and stops
        the worker; ``try_run`` then returns ``False``.
        """
        with self._lock:
            if user not in self._users:
                self._users.add(user)
                weakref.finalize(user, self._user_gone)
            if self._busy or self._stopped:
                return False
            self._busy = True
            self._tasks.put((task, after))
        return True

    def stop(self) -> None:
        """Let the thread end after the task it runs, if any (any thread; never waits)."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._tasks.put(None)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end (after ``stop``)."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _user_gone(self) -> None:
        # May run on any thread, this one included: stop without waiting. Iterating yields the
        # live users only (the dead one may not have left the set yet).
        with self._lock:
            if next(iter(self._users), None) is None:
                self.stop()

    def _loop(self) -> None:
        while True:
            queued = self._tasks.get()
            if queued is None:
                return
            self._run_one(*queued)
            del queued  # hold nothing of the session between tasks

    def _run_one(self, task: Task, after: Task) -> None:
        try:
            task()
        except BaseException:  # a task reports its own errors; never let the worker die silently
            _logger.exception("capture worker: a task raised")
        finally:
            with self._lock:
                self._busy = False
        after()  # free first: a capture started right after this one finds the worker idle


_workers: Final[dict[str, CaptureWorker]] = {}
_workers_lock: Final = threading.Lock()


def capture_worker(device: object) -> CaptureWorker:
    """The device's worker, started (again) if it has none alive."""
    key = str(device)
    with _workers_lock:
        worker = _workers.get(key)
        if worker is None or not worker.alive:
            worker = _workers[key] = CaptureWorker(f"cudagraph-capture-worker-{key}")
        return worker


def run_capture(device: object, task: Task, user: object, name: str, after: Task) -> None:
    """Run ``task``, then ``after``, on the device's worker, or on a new thread if the worker is busy."""
    if capture_worker(device).try_run(task, user, after):
        return

    def run() -> None:
        try:
            task()
        finally:
            after()

    threading.Thread(target=run, name=name, daemon=True).start()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit: every worker ends after its task (a capture in flight gets a few seconds)."""
    with _workers_lock:
        workers = list(_workers.values())
        _workers.clear()
    for worker in workers:
        worker.stop()
    for worker in workers:
        worker.join(_JOIN_AT_EXIT_S)
