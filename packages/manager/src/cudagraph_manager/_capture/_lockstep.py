"""A background capture with ranks: no thread; the serving steps capture, every rank the same keys together.

With ``ManagerOptions(ranks=...)`` a key's warm-up and recording may hold
collectives, so a capture thread's would meet the serving steps' in a
different order on each rank (a hang, or wrong data). ``start_capture()``
returns a ``LockstepCapture`` there, and the manager's ``Lockstep`` (the
step path's hook, built with the manager) carries its protocol in a field of
every step's exchange (``LockstepField``). Its states, what each rank sends
and what every rank then does (docs/design.md, "With ranks", has the table):

- **idle** (no capture, or it ended): ``IDLE``. Nothing.
- **running** (``start_capture()`` called, not ended; with 0 keys left
  too: a rank takes part until every rank is done): ``RUNNING``, its plan's
  digest, its keys left, the keys it takes a turn (``keys_per_step``; every
  key inside ``wait()``). Where every rank runs with the same plan and some
  rank has keys left, a turn: the union of every rank's keys left (one
  exchange), the first of it (the fewest any rank takes) captured by every
  rank (``_together``: a rank that holds the key records it again), each
  kept by all or by none and tried again alike. No keys left anywhere, or
  the union's last key captured: every rank's capture ends, in this step.
  Some rank idle: no turn (logged once).
- **stopped** (``stop()`` or ``release()`` here since the last exchange):
  ``STOPPED``, once. Every rank's running capture ends in that step.

Every rank sends a row of one shape in every step, whatever it holds, so
the exchanges, the turns and their collectives line up on every rank.
``wait()`` takes steps of 0 tokens until the capture ends: each is a step's
exchange, so it meets a peer's step or a peer's ``wait()`` alike. ``stop()``
is never a collective: it ends this rank's capture now and the others' at
the next exchange.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple, Protocol

from cudagraph_dispatch import BatchDescriptor

from .._reports._report import CapturedGraph, CaptureReport
from .._reports._totals import CaptureTotals
from ..ranks import RankAgreement, RanksDisagreeError
from ._retry import RETRIES
from ._together import Together, union_of

_logger: Final = logging.getLogger("cudagraph_manager")

IDLE: Final = 0
RUNNING: Final = 1
STOPPED: Final = 2
#: A running rank's plan field where it cannot capture (its digest otherwise, never negative).
CANNOT_CAPTURE: Final = -1
#: The keys a turn takes inside ``wait()``: every key left.
EVERY_KEY: Final = 2**31


class LockstepField(NamedTuple):
    """A rank's lockstep field in a step's exchange (``RankAgreement.route_step``'s ``field``)."""

    state: int  # IDLE, RUNNING or STOPPED
    plan: int  # RUNNING: the digest of its plan, or CANNOT_CAPTURE
    keys_left: int  # RUNNING: its keys not captured and not tried by this capture
    keys_per_turn: int  # RUNNING: the keys it takes in one turn


_IDLE_FIELD: Final = tuple(LockstepField(IDLE, 0, 0, 0))
_STOPPED_FIELD: Final = tuple(LockstepField(STOPPED, 0, 0, 0))


class LockstepJobs(Protocol):
    """What the lockstep capture asks of its manager's captures (``Capturer``).

    ``pending_keys``: this rank's keys without a graph, in plan order (none
    where it captures nothing); ``why_not_capture``: why it cannot capture
    now (``None``: it can); ``capture_together(key)``: the key warmed up and
    recorded on every rank (a graph this rank held dropped first), kept by
    all or by none (one exchange).
    """

    def start_totals(self) -> CaptureTotals: ...

    def report(
        self, totals: CaptureTotals, graphs: Sequence[CapturedGraph], why: str | None
    ) -> CaptureReport: ...

    def pending_keys(self) -> list[BatchDescriptor]: ...

    def why_not_capture(self) -> str | None: ...

    def capture_together(self, key: BatchDescriptor, /) -> Together: ...


class Lockstep:
    """One manager's part in the lockstep protocol (with ranks): the step path's hook (``StepHook``).

    ``field()`` is this rank's field of each step's exchange; ``stepped()``,
    called with every rank's right after it, ends the running capture or
    takes its turn, and says whether every rank's capture was running (strict
    mode then runs the step's eager forward). ``idle_step`` runs one step of
    0 tokens on the manager (held weakly: the manager holds this).
    """

    __slots__ = ("_digest", "_idle_step", "_jobs", "_plan", "_ranks", "_session", "_stopped", "_waiting")

    def __init__(
        self,
        ranks: RankAgreement,
        jobs: LockstepJobs,
        plan: Sequence[BatchDescriptor],
        digest: int,
        idle_step: Callable[[], Callable[[], None] | None],
    ) -> None:
        self._ranks: Final = ranks
        self._jobs: Final = jobs
        self._plan: Final = tuple(plan)  # every key, in plan order: the union's order
        self._digest: Final = digest
        self._idle_step: Final = idle_step
        self._session: LockstepCapture | None = None
        self._stopped = False  # a stop() here that the next exchange announces
        self._waiting = False  # inside wait(): a turn takes every key left

    @property
    def session(self) -> LockstepCapture | None:
        """The capture still running on this rank, if one is."""
        session = self._session
        return session if session is not None and not session.done else None

    def start(self, keys_per_step: int) -> LockstepCapture:
        """A new capture of this rank; it takes part from the next step's exchange (never a collective)."""
        session = LockstepCapture(self, self._jobs, keys_per_step, len(self._jobs.pending_keys()))
        self._session = session
        return session

    def field(self) -> tuple[int, ...]:
        """This rank's field of the next step's exchange (``LockstepField``)."""
        if self._stopped:
            return _STOPPED_FIELD
        session = self.session
        if session is None:
            return _IDLE_FIELD
        plan = self._digest if self._jobs.why_not_capture() is None else CANNOT_CAPTURE
        per_turn = EVERY_KEY if self._waiting else session.keys_per_step
        return tuple(LockstepField(RUNNING, plan, len(session.left()), per_turn))

    def stepped(self, fields: Sequence[tuple[int, ...]]) -> bool:
        """After a step's exchange (every rank's field, by rank): end, wait or take a turn; never raises.

        Returns whether every rank's capture was running in this exchange.
        """
        rows = [LockstepField(*field) for field in fields]
        mine = rows[self._ranks.rank]
        if mine.state == STOPPED:
            self._stopped = False  # announced
        everywhere = all(row.state == RUNNING for row in rows)
        session = self.session
        if session is None or mine.state != RUNNING:  # none, or started after this field was sent
            return everywhere
        stopped = [r for r, row in enumerate(rows) if row.state == STOPPED]
        if stopped:
            session.end(f"stopped on rank(s) {stopped} (stop() or release())")
            return False
        if not everywhere:
            session.waiting_for([r for r, row in enumerate(rows) if row.state != RUNNING])
            return False
        if len({row.plan for row in rows}) > 1:
            session.end("the ranks disagree on the plan", _disagreement(rows))
            return True
        if any(row.keys_left for row in rows):
            self._turn(session, min(row.keys_per_turn for row in rows))
        else:
            session.end()
        return True

    def stop(self, session: LockstepCapture) -> None:
        """``session`` was stopped here: the next exchange tells every rank (its capture ends there)."""
        if session is self._session:
            self._stopped = True

    def wait_step(self) -> None:
        """One step of 0 tokens for ``wait()``: its exchange, and the turn, of every key left."""
        step = self._idle_step()
        if step is None:
            raise RuntimeError("wait(): the manager of this lockstep capture is gone")
        self._waiting = True
        try:
            step()
        finally:
            self._waiting = False

    def _turn(self, session: LockstepCapture, count: int) -> None:
        """Capture the first ``count`` keys of the union of every rank's keys left, on every rank."""
        union = union_of(self._ranks, self._plan, set(session.left()))
        session.planned(len(union))
        for key in union[:count]:
            session.capture(key)
        if count >= len(union):  # every rank knows the union is done: every capture ends now
            session.end()


class LockstepCapture:
    """``start_capture()`` with ranks: the ``BackgroundCapture`` handle of a capture the steps take turns at.

    ``progress``'s total is this rank's keys left until the first turn, then
    the union of every rank's. ``wait()`` takes steps of 0 tokens until the
    capture ends (each one step's exchange, on every rank: docs/design.md,
    "With ranks"); ``stop()`` ends it here now, and on every rank at the next
    exchange.
    """

    __slots__ = (
        "_errors",
        "_finished",
        "_jobs",
        "_lockstep",
        "_records",
        "_report",
        "_retries",
        "_thread",
        "_total",
        "_totals",
        "_tried",
        "_waited",
        "keys_per_step",
    )

    def __init__(self, lockstep: Lockstep, jobs: LockstepJobs, keys_per_step: int, total: int) -> None:
        self._lockstep: Final = lockstep
        self._jobs: Final = jobs
        self.keys_per_step: Final = keys_per_step
        self._totals: Final = jobs.start_totals()
        self._tried: Final[set[BatchDescriptor]] = set()  # keys this capture captured or gave up on
        self._records: Final[list[CapturedGraph]] = []
        self._errors: Final[list[BaseException]] = []
        self._finished = 0
        self._total = total
        self._retries = 0
        self._report: CaptureReport | None = None
        self._thread = 0  # the serving thread while it takes a turn
        self._waited = False  # "waiting for ranks ..." logged

    # -- the handle --

    @property
    def done(self) -> bool:
        return self._report is not None

    @property
    def progress(self) -> tuple[int, int]:
        return self._finished, self._total

    @property
    def errors(self) -> tuple[BaseException, ...]:
        return tuple(self._errors)

    @property
    def retries(self) -> int:
        return self._retries

    def wait(self, timeout: float | None = None) -> CaptureReport:
        """Take steps of 0 tokens until the capture ends on every rank; its report.

        Each is one step's exchange (an idle step, or this rank's dummy step
        in a peer's step), and a turn takes every key left: call it on every
        rank, or let the other ranks step meanwhile. ``TimeoutError`` once
        ``timeout`` seconds passed between steps; the ranks stay in step.
        """
        given: object = timeout
        if given is not None and (
            isinstance(given, bool) or not isinstance(given, (int, float)) or not given >= 0
        ):
            raise ValueError(f"timeout: expected None or a number of seconds >= 0, got {timeout!r}")
        if self._thread == threading.get_ident():
            raise RuntimeError("wait(): called from inside the capture it waits for (the model, on its turn)")
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._report is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the lockstep capture is not done after {timeout} s ({self.progress})")
            self._lockstep.wait_step()
        return self._report

    def stop(self) -> None:
        """Capture no further key: ended here now, on every rank at the next exchange (never a collective)."""
        if self._report is None:
            self._lockstep.stop(self)
            self.end("stop() or release() here")

    # -- the lockstep's side --

    def left(self) -> list[BatchDescriptor]:
        """This rank's keys without a graph that this capture has not tried, in plan order."""
        return [key for key in self._jobs.pending_keys() if key not in self._tried]

    def planned(self, union: int) -> None:
        """A turn found ``union`` keys left on some rank: the total this capture captures."""
        self._total = self._finished + union

    def capture(self, key: BatchDescriptor) -> None:
        """``key`` on every rank (retried alike where every failed rank's capture was invalidated)."""
        self._thread = threading.get_ident()  # wait() from inside the model would wait for itself
        try:
            for attempt in range(RETRIES + 1):
                together = self._jobs.capture_together(key)
                if together.record is not None:
                    self._records.append(together.record)
                    break
                assert together.error is not None
                if together.retry and attempt < RETRIES:
                    self._retries += 1
                    _logger.warning("lockstep capture of %s failed, trying again: %s", key, together.error)
                    continue
                _logger.error("lockstep capture gave up on %s: %s", key, together.error)
                self._errors.append(together.error)
                break
        finally:
            self._thread = 0
        self._tried.add(key)
        self._finished += 1

    def waiting_for(self, ranks: Sequence[int]) -> None:
        """No turn: ``ranks`` have no capture running (logged once)."""
        if not self._waited:
            self._waited = True
            _logger.warning(
                "lockstep capture (start_capture() with ranks): waiting for rank(s) %s to call "
                "start_capture(); until every rank has, no key is captured and the steps run eagerly",
                list(ranks),
            )

    def end(self, why: str | None = None, error: BaseException | None = None) -> None:
        """The capture ends here (``why`` it ended early, if it did; ``error`` kept and logged)."""
        if self._report is not None:
            return
        if error is not None:
            _logger.error("lockstep capture ended: %s", error)
            self._errors.append(error)
        left = len(self.left())
        if why is not None and left:
            why = f"stopped ({why}) with {left} keys left"
        self._report = self._jobs.report(self._totals, self._records, why)


def _disagreement(rows: Sequence[LockstepField]) -> RanksDisagreeError:
    """The error every rank keeps where the running captures' plans differ (or one cannot capture)."""
    if any(row.plan == CANNOT_CAPTURE for row in rows):
        return RanksDisagreeError(
            "whether to capture",
            ["cannot capture" if row.plan == CANNOT_CAPTURE else "can capture" for row in rows],
            "; start_capture() needs every rank able to capture CUDA graphs",
        )
    return RanksDisagreeError(
        "the capture plan",
        [f"digest {row.plan:#010x}" for row in rows],
        "; every rank must build its manager with the same config",
    )
