"""One capture thread per device that outlives the background captures, so a wake starts warm.

Library handles and plans belong to a thread (cuDNN builds an attention plan
per shape, slowly, the first time), so a background capture on a new thread
would pay them again for every size. ``CaptureWorker`` runs a device's
background captures one after another and keeps that state between them. A
session that finds it busy runs on a thread of its own. The worker stops
once no manager that used it is alive, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Final

_logger: Final = logging.getLogger("cudagraph_manager")
_JOIN_AT_EXIT_S: Final = 5.0

Job = Callable[[], None]


class CaptureWorker:
    """A daemon thread that runs capture jobs one at a time (``try_run``) until ``stop``."""

    __slots__ = ("_busy", "_jobs", "_lock", "_stopped", "_thread", "_users")

    def __init__(self, name: str) -> None:
        self._jobs: Final[queue.SimpleQueue[tuple[Job, Job] | None]] = queue.SimpleQueue()
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

    def try_run(self, job: Job, user: object, after: Job) -> bool:
        """Queue ``job`` and return ``True``, unless the worker is busy or stopped (``False``).

        ``after`` runs on the worker once the job is done and the worker is
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
            self._jobs.put((job, after))
        return True

    def stop(self) -> None:
        """Let the thread end after the job it runs, if any (any thread; never waits)."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._jobs.put(None)

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
            queued = self._jobs.get()
            if queued is None:
                return
            self._run_one(*queued)
            del queued  # hold nothing of the session between jobs

    def _run_one(self, job: Job, after: Job) -> None:
        try:
            job()
        except BaseException:  # a job reports its own errors; never let the worker die silently
            _logger.exception("capture worker: a job raised")
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


def run_capture(device: object, job: Job, user: object, name: str, after: Job) -> None:
    """Run ``job``, then ``after``, on the device's worker, or on a new thread if the worker is busy."""
    if capture_worker(device).try_run(job, user, after):
        return

    def run() -> None:
        try:
            job()
        finally:
            after()

    threading.Thread(target=run, name=name, daemon=True).start()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit: every worker ends after its job (a capture in flight gets a few seconds)."""
    with _workers_lock:
        workers = list(_workers.values())
        _workers.clear()
    for worker in workers:
        worker.stop()
    for worker in workers:
        worker.join(_JOIN_AT_EXIT_S)
