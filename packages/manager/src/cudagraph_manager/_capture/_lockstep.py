"""A background capture with ranks: no thread, the keys captured by the serving thread, in lockstep.

With ``ManagerOptions(ranks=...)`` the model's warm-ups (and the graphs)
hold collectives, so a capture thread's warm-ups would meet the serving
steps' collectives in a different order on each rank: a hang, or wrong data.
``LockstepCapture`` is what ``start_capture()`` returns there: the same
handle (``BackgroundCapture``), but the serving thread captures the keys,
``keys_per_step`` of them at a step boundary, once every rank has started
its capture (each step's agreement row carries the digest of the keys a
rank has left, ``RankAgreement.route_step``), in plan order on every rank,
each kept by every rank or by none (``RankAgreement.all_or_none``). Why not
a thread, and what a capturing step costs: docs/design.md,
"Background capture" and "Ranks".
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Final

from cudagraph_dispatch import BatchDescriptor

from .._parts import StepLock
from .._protocols import CaptureJobs
from .._reports._report import CapturedGraph, CaptureReport
from ..ranks import RankAgreement, RanksDisagreeError
from ..ranks._agreement import CAPTURE_STOPPED
from ._background import BackgroundCapture, BackgroundTimings
from ._warm_up import WarmUps

_NO_WARM_UPS: Final = WarmUps((), frozenset())


class LockstepCapture(BackgroundCapture):
    """``start_capture()`` with ranks: the serving thread captures the keys, every rank the same in one step.

    ``token`` is what this rank's agreement row carries (0 once done or
    stopped); ``turn()`` captures the next ``keys_per_step`` keys, called
    by the step path once every rank's token is the same. ``wait()`` is a
    collective: every rank calls it, and they capture the keys left together.
    """

    __slots__ = ("_capture_one", "_keys_per_step", "_ranks", "_step_lock", "_token", "_totals")

    def __init__(
        self,
        pending: Sequence[BatchDescriptor],
        jobs: CaptureJobs,
        *,
        ranks: RankAgreement,
        capture_one: Callable[[BatchDescriptor], CapturedGraph],
        step_lock: StepLock,
        keys_per_step: int,
    ) -> None:
        super().__init__(
            pending, _NO_WARM_UPS, jobs, timings=BackgroundTimings()
        )  # no first step to wait for
        self._ranks: Final = ranks
        self._capture_one: Final = capture_one  # warm-up and record, kept by every rank or none
        self._step_lock: Final = step_lock
        self._keys_per_step: Final = keys_per_step
        self._token = 0
        self._totals = jobs.start_totals()

    @property
    def token(self) -> int:
        """This rank's agreement field: the digest of the keys left, ``CAPTURE_STOPPED`` or 0 once done."""
        if self._done.is_set():
            return 0
        return CAPTURE_STOPPED if self._stop.is_set() else self._token

    def start(self) -> None:
        """No thread, no warm-up now: the steps capture once every rank has started (never a collective)."""
        self._token = _digest(self._pending)
        if not self._pending:
            self._end()

    def turn(self) -> None:
        """Capture the next ``keys_per_step`` keys (every rank the same, in this step); never raises.

        A key that fails on one rank is dropped by all (tried again up to
        ``RETRIES`` more times, by every rank alike); its error is kept.
        """
        self._thread = threading.get_ident()  # wait() from inside the model would wait for itself
        try:
            for _ in range(self._keys_per_step):
                if not self._pending:
                    break
                self._capture_with_retries(self._pending.pop(0))
        finally:
            self._thread = 0
        self._token = _digest(self._pending)
        if not self._pending:
            self._end()

    def stepped(self) -> None:
        """After a step's exchange: where some rank's capture was stopped, every rank's ends here."""
        if (self._stop.is_set() or CAPTURE_STOPPED in self._ranks.capture_tokens) and not self._done.is_set():
            self._stop.set()
            self._end()

    def wait(self, timeout: float | None = None) -> CaptureReport:
        """Capture every key left now, every rank together (a collective), and return the report.

        Every rank calls it at the same point of its steps (one exchange of
        the tokens, then the turns, each with its own); ``timeout`` is
        checked but not used: the ranks wait for each other. A capture done
        (every rank's ends in the same step: the last key, or a ``stop()``
        seen in a step's exchange) or stopped here returns its report
        without an exchange (``stop()`` and ``release()`` go to every rank);
        ``RanksDisagreeError`` on every rank where the keys left differ.
        """
        given: object = timeout
        if given is not None and (
            isinstance(given, bool) or not isinstance(given, (int, float)) or not given >= 0
        ):
            raise ValueError(f"timeout: expected None or a number of seconds >= 0, got {timeout!r}")
        if self._thread == threading.get_ident():
            raise RuntimeError("wait(): called from inside the capture it waits for (the model, on its turn)")
        if not self._done.is_set():
            if self._stop.is_set():  # this rank's own stop: the others see it in their next step's exchange
                self._end()
            else:
                with self._step_lock.held("wait"):
                    self._drive()
        assert self._report is not None
        return self._report

    def _drive(self) -> None:
        """``wait()``'s captures: one exchange of the tokens, then every key left, one turn each.

        The turns ignore a ``stop()`` made meanwhile: every rank agreed on them.
        """
        tokens = [row[0] for row in self._ranks.exchange((self.token,))]
        if CAPTURE_STOPPED in tokens:  # every rank's capture ends, as at a step
            self._stop.set()
            self._end()
            return
        if len(set(tokens)) > 1 or not all(tokens):
            raise RanksDisagreeError(
                "the keys left to capture in wait()",
                [f"digest {t:#x}" if t else "stopped or done" for t in tokens],
                "; every rank calls wait() on its capture at the same step, with the same keys left",
            )
        while self._pending:
            self.turn()

    def _record(self, key: BatchDescriptor) -> CapturedGraph:
        return self._capture_one(key)

    def _end(self) -> None:
        self._finish(self._totals)
        self._done.set()


def _digest(keys: Sequence[BatchDescriptor]) -> int:
    """The keys left, as one nonzero int64 for the agreement row (0 would mean "not capturing")."""
    return (1 << 32) | zlib.crc32(repr(list(keys)).encode())
