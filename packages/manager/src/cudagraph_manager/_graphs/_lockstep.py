"""Ranks that capture together (the same keys, each kept by all or by none), and the lockstep capture.

With ``ManagerOptions(ranks=...)`` a key's warm-up and recording may hold
collectives (a tensor-parallel all-reduce, an expert-parallel all-to-all),
so every rank warms up and records the same keys in the same order, whatever
each holds. What they capture is the union of the keys any rank misses (one
rank's ``clear()`` or ``release()``, a fault): a rank that holds a key of the
union drops its graph and records the key again with the others, since only
a recording meets a recording's collectives (over NCCL a recording launches
nothing, an eager forward would; a model whose collectives run on the host
runs them in both). ``capture()``, ``estimate_memory()`` and the lockstep
capture's turns all come here (docs/design.md, "With ranks").

``start_capture()`` with ranks has no thread: a capture thread's warm-ups
would meet the serving steps' collectives in a different order on each rank
(a hang, or wrong data). It returns a ``LockstepCapture``, and the
manager's ``Lockstep`` (built with the manager, called by every step)
carries its protocol in a field of every step's exchange (``LockstepField``).
Its states, what each rank sends and what every rank then does
(docs/design.md, "With ranks", has the table):

- **idle** (no capture, or it ended): ``IDLE``. Nothing.
- **running** (``start_capture()`` called, not ended; with 0 keys left
  too: a rank takes part until every rank is done): ``RUNNING``, its plan's
  digest, its keys left, the keys it takes a turn (``keys_per_step``; every
  key inside ``wait()``). Where every rank runs with the same plan and some
  rank has keys left, a turn: the union of every rank's keys left (one
  exchange), the first of it (the fewest any rank takes) captured by every
  rank (``on_every_rank``: a rank that holds the key records it again), each
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
import sys
import threading
import time
import zlib
from collections.abc import Callable, Collection, Sequence
from typing import Final, NamedTuple, Protocol

from cudagraph_capture import CaptureError
from cudagraph_capture._enabled import capture_disabled_reason
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode

from .._memory._device import CaptureTotals
from .._values._protocols import OutputT
from .._values._reports import CapturedGraph, CaptureReport
from ..ranks import RankAgreement, RanksDisagreeError
from ._recording import RETRIES, worth_retrying
from ._table import GraphTable, PlannedGraph

_logger: Final = logging.getLogger("cudagraph_manager")

#: Keys per int of a bit mask of the plan (an int64 row holds 63 bits without its sign).
_BITS: Final = 63


class PlanRow(NamedTuple):
    """A rank's row of the plan agreement: its whole plan's digest and length, whether it can capture."""

    digest: int
    num_keys: int
    can_capture: bool


class Together(NamedTuple):
    """One key's capture on every rank, as every rank learnt it in one exchange.

    ``record``: the key's graph, kept (every rank succeeded); else ``error``:
    this rank's own error, or a ``CaptureError`` naming the ranks that failed
    (this rank's graph of the key dropped). ``retry``: the same on every rank,
    true where every failed rank's error is worth retrying (``worth_retrying``).
    """

    record: CapturedGraph | None
    error: Exception | None
    retry: bool


def plan_digest(plan: Sequence[tuple[CUDAGraphMode, BatchDescriptor]]) -> int:
    """The plan as one non-negative int (its keys and modes, in order)."""
    return zlib.crc32(repr([(mode.name, key) for mode, key in plan]).encode())


def planned(table: GraphTable[OutputT]) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
    """The whole plan of ``table`` (captured keys too), in capture order."""
    return [(graph.mode, graph.descriptor) for graph in table.graphs.values()]


def why_not_capture(no_graphs: str | None) -> str | None:
    """Why this rank captures nothing now (``no_graphs``, or captures turned off), ``None`` if it captures."""
    return no_graphs or capture_disabled_reason()


def keys_to_capture(
    ranks: RankAgreement | None, table: GraphTable[OutputT], no_graphs: str | None
) -> list[PlannedGraph[OutputT]]:
    """The keys ``capture()`` (or ``estimate_memory()``) captures here, in capture order.

    Without ranks: the pending ones. With ranks (two exchanges): every rank
    must plan the same keys and be able to capture (``RanksDisagreeError``
    on every rank, before any capture, where one cannot or plans others),
    then the union of every rank's pending keys; none where no rank can capture.
    """
    pending = table.pending()
    if ranks is None:
        return pending
    why = why_not_capture(no_graphs)
    agree_plan(ranks, planned(table), why)
    if why is not None:  # every rank agreed it captures nothing
        return pending
    union = set(union_of(ranks, list(table.graphs), {graph.descriptor for graph in pending}))
    return [graph for key, graph in table.graphs.items() if key in union]


def agree_plan(
    ranks: RankAgreement, plan: Sequence[tuple[CUDAGraphMode, BatchDescriptor]], why_not: str | None
) -> None:
    """``RanksDisagreeError`` on every rank unless every rank plans ``plan`` and all can capture (or none).

    One exchange of a ``PlanRow``; ranks that all capture nothing (no CUDA
    anywhere) agree.
    """
    mine = PlanRow(plan_digest(plan), len(plan), why_not is None)
    exchanged = ranks.exchange((mine.digest, mine.num_keys, int(mine.can_capture)))
    rows = [PlanRow(digest, num_keys, bool(ok)) for digest, num_keys, ok in exchanged]
    if len({row.can_capture for row in rows}) > 1:
        without = [r for r, row in enumerate(rows) if not row.can_capture]
        here = f"; here (rank {ranks.rank}): {why_not}" if why_not is not None else ""
        raise RanksDisagreeError(
            "whether to capture",
            ["can capture" if row.can_capture else "cannot capture" for row in rows],
            f": rank(s) {without} cannot capture CUDA graphs{here}",
        )
    if len({(row.digest, row.num_keys) for row in rows}) > 1:
        raise RanksDisagreeError(
            "the capture plan",
            [f"{row.num_keys} keys, digest {row.digest:#010x}" for row in rows],
            "; every rank must build its manager with the same config (the keys each rank "
            "misses may differ: they are captured together)",
        )


def union_of(
    ranks: RankAgreement, plan: Sequence[BatchDescriptor], left: Collection[BatchDescriptor]
) -> list[BatchDescriptor]:
    """Every key of ``plan`` some rank has in ``left``, in plan order: one exchange of bit masks.

    Every rank passes the same ``plan`` (agreed before): the rows have one width.
    """
    words = [0] * max(1, -(-len(plan) // _BITS))  # [ceil(keys / 63)]
    for i, key in enumerate(plan):
        if key in left:
            words[i // _BITS] |= 1 << (i % _BITS)
    union = [0] * len(words)
    for row in ranks.exchange(words):
        union = [a | b for a, b in zip(union, row, strict=True)]
    return [key for i, key in enumerate(plan) if union[i // _BITS] >> (i % _BITS) & 1]


def on_every_rank(
    ranks: RankAgreement,
    key: BatchDescriptor,
    attempt: Callable[[], CapturedGraph],
    undo: Callable[[], None],
) -> Together:
    """``attempt()`` (the capture of ``key``) on every rank, kept only where every rank succeeded.

    One exchange: each rank's failure, and whether it is worth retrying.
    An exception (not a ``KeyboardInterrupt``) is held until the ranks have
    compared notes, so a failure on one rank never leaves the others waiting
    in their next collective; the ranks that succeeded then ``undo()`` (the
    graphs of all ranks stay the same set).
    """
    error: Exception | None = None
    record: CapturedGraph | None = None
    try:
        record = attempt()
    except Exception as exc:
        error = exc
    mine = (int(error is not None), int(error is not None and worth_retrying(error)))
    rows = ranks.exchange(mine)
    failed = [r for r, (bad, _) in enumerate(rows) if bad]
    retry = bool(failed) and all(again for bad, again in rows if bad)
    if error is not None:
        if sys.version_info >= (3, 11):
            error.add_note(f"rank {ranks.rank} of {ranks.world_size}: every rank dropped {key}")
        return Together(None, error, retry)
    if failed:
        undo()
        failure = CaptureError(
            f"rank(s) {failed} of {ranks.world_size} failed to capture this key, so rank "
            f"{ranks.rank} dropped it too; their errors say why",
            key,
        )
        return Together(None, failure, retry)
    return Together(record, None, False)


# -- the lockstep capture --

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
    """One manager's part in the lockstep protocol (with ranks), called by every step's plan.

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
        rank, or let the other ranks step meanwhile.

        Args:
            timeout: seconds to wait at most, checked between steps (the ranks
                stay in step); ``None``: no bound.

        Returns:
            The capture's report.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            ValueError: ``timeout`` is no number of seconds >= 0.
            RuntimeError: called from inside the capture (the model, on its turn).
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
