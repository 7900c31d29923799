"""Ranks that step together: one small all-reduce per step makes them agree.

``RankAgreement`` is the group those ranks agree over (docs/design.md,
"Ranks", says why they must). Each exchange is one all-reduce of a
``[world_size, width]`` int64 table in which every rank fills its own row
(the layout of vLLM's ``coordinate_batch_across_dp``), so every rank reads
every rank's values and computes the same answer locally. A step's row is a
``StepRow``, read by name: the request, whether the rank can replay, and an
opaque field of ``FIELD_WIDTH`` ints for whoever drives the steps (the
manager's lockstep capture), so a step's rows have one shape on every rank,
whatever each carries. Nothing here knows what a capture is.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Final, Literal, NamedTuple

import torch
import torch.distributed as dist

from cudagraph_capture.lowlevel import resolve_device
from cudagraph_dispatch import (
    BatchDescriptor,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    Dispatch,
    EagerReason,
    agree_across_ranks,
)
from cudagraph_dispatch._request import NO_MODES, RankRequest
from cudagraph_dispatch._rule import Route

from ._shared_table import SharedTable, shared_memory_supported

Backend = Literal["gloo", "nccl", "shm"]

#: The forward context's extra (``get_forward_context().extra[NUM_TOKENS_ACROSS_DP]``) of an eager
#: step with ranks: every rank's token count in the step's exchange, by rank (vLLM's name).
NUM_TOKENS_ACROSS_DP: Final = "num_tokens_across_dp"
#: Ints of a step row's opaque field (``route_step(field=...)``): shorter fields are padded with 0.
FIELD_WIDTH: Final = 4

_NONE: Final = CUDAGraphMode.NONE
_MODES: Final = tuple(CUDAGraphMode)
_BACKENDS: Final[tuple[str, ...]] = ("gloo", "nccl", "shm")
_DEFAULT_TIMEOUT: Final = datetime.timedelta(minutes=30)  # torch's default for gloo groups
#: The timeouts torch's groups take: milliseconds, and the stores' int64 nanoseconds (a year is ample).
_TIMEOUTS: Final = (datetime.timedelta(milliseconds=1), datetime.timedelta(days=365))
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1


class RanksDisagreeError(RuntimeError):
    """Ranks of one ``RankAgreement`` would do different things; raised on every rank alike.

    ``what`` names the thing they disagree on; ``values`` holds each rank's
    value, by rank.
    """

    def __init__(self, what: str, values: Sequence[object], detail: str = "") -> None:
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        super().__init__(f"ranks disagree on {what} ({per_rank}){detail}")
        self.what = what
        self.values = tuple(values)


class RankAgreement:
    """The ranks that run every step together, and the exchange that keeps them in step.

    ``group`` is the process group of those ranks (default: the whole world).
    ``backend`` is where the per-step all-reduce runs: ``"gloo"`` (default)
    exchanges CPU tensors over a gloo group of the same ranks, created here
    (a collective call over ``group`` alone: every rank of ``group``
    constructs its ``RankAgreement`` at the same point); ``"nccl"`` exchanges
    on ``device`` (default: the current CUDA device) and reads the result
    back, which synchronizes with that device's current stream; ``"shm"``
    exchanges through shared memory, for ranks that all run on this host
    (x86-64 only), with no socket and no GPU involved: the fastest of the
    three. ``backend=None`` uses ``group`` itself, whatever its backend and
    its timeout. ``timeout`` bounds every exchange of a group created here:
    over gloo and shm a rank that never arrives makes the others raise
    (after which this agreement is out of step: build a new one, or end the
    process); over nccl, NCCL's watchdog aborts the process instead.

    Give it to ``CUDAGraphManager(..., options=ManagerOptions(ranks=...))``; every rank of the group
    then runs the same mode at the same padded size on each ``run()``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        backend: Backend | None = "gloo",
        device: torch.device | str | int | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        target = _check_arguments(group, backend, device, timeout)
        group, chosen = _agreement_group(group, backend, timeout)
        self._group: Final = group
        self._backend: Final = chosen
        self._rank: Final = dist.get_rank(group)
        self._world_size: Final = dist.get_world_size(group)
        self._timeout: Final = timeout  # None: the group's own
        self._device: Final = _exchange_device(chosen, device, target)
        # nccl: per table size, a pinned host table and its device twin, reused by every exchange.
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._counts: tuple[int, ...] = ()  # every rank's tokens in the last step's exchange
        self._table: Final = (
            SharedTable(group, self._rank, self._world_size, (timeout or _DEFAULT_TIMEOUT).total_seconds())
            if chosen == "shm"
            else None
        )

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group the exchanges run over."""
        return self._group

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def rank(self) -> int:
        """This rank's index in the group (its row in every exchange)."""
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def num_tokens_across_dp(self) -> tuple[int, ...]:
        """Every rank's token count in the last step's exchange, by rank (``()`` before the first step)."""
        return self._counts

    def exchange(self, row: Sequence[int]) -> list[tuple[int, ...]]:
        """Every rank's ``row`` (one int at least, the same length on every rank), by rank: one all-reduce.

        A collective: every rank of the group calls it, in the same order as
        its other exchanges, with a row of the same width (any width, on
        every backend: the shared-memory table grows, in step on every rank,
        the first time a wider row comes). Synchronizes with the exchange (a
        CPU wait for gloo, a device-to-host copy for nccl). A row that is not
        a list or tuple of one int or more of the int64 range (``bool`` is no
        int here) raises ``ValueError`` naming it, on the calling rank, before
        the exchange (its peers then wait until the timeout). An empty row
        is refused: it would exchange nothing, and a table of 0 columns
        cannot tell which rank wrote which row; use ``(0,)`` for a barrier.
        """
        _check_row(row)
        if self._table is not None:
            return self._table.exchange(row)
        width = len(row)
        table = [0] * (width * self._world_size)  # [world_size, width], row-major
        start = self._rank * width
        table[start : start + width] = row
        tensor = torch.tensor(table, dtype=torch.int64)
        if self._device.type == "cuda":
            flat = self._all_reduced_on_device(tensor)
        else:
            flat = self._all_reduced_on_cpu(tensor)
        return [tuple(flat[r * width : (r + 1) * width]) for r in range(self._world_size)]

    def _all_reduced_on_cpu(self, table: torch.Tensor) -> list[int]:
        """Every rank's ``table`` (CPU) summed over the group; ``TimeoutError`` if a rank is missing."""
        try:
            dist.all_reduce(table, group=self._group)  # each entry is one rank's: the sum is the table
        except RuntimeError as error:
            if "timed out" not in str(error).lower():
                raise
            waited = "its timeout" if self._timeout is None else f"{self._timeout.total_seconds():g} s"
            raise TimeoutError(
                f"rank {self._rank} of {self._world_size}: the exchange over {self._backend} timed out "
                f"after {waited}: a rank did not arrive (it stopped, hangs, or steps differently)"
            ) from error
        flat: list[int] = table.tolist()
        return flat

    def _all_reduced_on_device(self, table: torch.Tensor) -> list[int]:
        """The sum of every rank's ``table`` (a CPU tensor), all-reduced on this rank's CUDA device."""
        host, device = self._staged(table.numel())
        host.copy_(table)
        device.copy_(host, non_blocking=True)  # pinned: a DMA on the current stream, no staging
        dist.all_reduce(device, group=self._group)
        host.copy_(device, non_blocking=True)
        # The host reads the table now: wait for this stream (it also frees host for the next exchange).
        torch.cuda.current_stream(self._device).synchronize()
        flat: list[int] = host.tolist()
        return flat

    def _staged(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pinned host table and its device twin for tables of ``size`` ints (made once)."""
        staged = self._staging.get(size)
        if staged is None:
            host = torch.zeros(size, dtype=torch.int64).pin_memory()
            staged = self._staging[size] = (host, torch.empty_like(host, device=self._device))
        return staged

    def agree_step(
        self, dispatcher: CUDAGraphDispatcher, request: RankRequest, *, can_replay: bool
    ) -> Dispatch:
        """The decision every rank runs this step (one exchange).

        ``agree_across_ranks`` over every rank's request, whose
        ``invalid_modes`` it unites (a mode off on one rank is off on all),
        and eager on all (unpadded, the largest count) when any rank cannot
        replay (``can_replay=False``: its graphs are not all captured), idle
        ranks included: they would replay the agreed graph too.
        """
        return _decided(dispatcher, self._exchanged(StepRow.of(request, can_replay, ())))

    def route_step(
        self,
        dispatcher: CUDAGraphDispatcher,
        request: RankRequest,
        *,
        can_replay: bool,
        field: Sequence[int] = (),
    ) -> StepRoute:
        """This rank's route for a step every rank runs alike (one exchange), and what the exchange held.

        The route is the agreed graph, or why this rank runs eagerly (another
        rank had no graph: ``OTHER_RANK``; ``EMPTY_BATCH`` for a rank with 0
        tokens; this rank's own reason otherwise). A dummy step is the step
        of a rank with 0 tokens that must still run because other ranks have
        tokens: it replays the agreed graph on pad values, or, when the
        others run eagerly, runs the model on one padding row so their
        collectives meet it (``stats.dummy_steps``). Only when every rank is
        idle does none call the model.

        ``field``: at most ``FIELD_WIDTH`` ints this rank's row carries for
        whoever drives the steps (padded with 0: every rank's row has one
        shape); ``StepRoute.fields`` holds every rank's, by rank, unread here.
        """
        # This rank's own route first: it checks the step's arguments before the exchange.
        r = request
        own = dispatcher.route(r.num_tokens, r.uniform_decode, r.num_active_loras, r.invalid_modes)
        rows = self._exchanged(StepRow.of(request, can_replay, field))
        agreed = _decided(dispatcher, rows)
        fields = tuple(row.field for row in rows)
        idle = request.num_tokens == 0
        if agreed.mode is not _NONE:
            return StepRoute(agreed, idle, own, fields)
        if idle:
            return StepRoute(EagerReason.EMPTY_BATCH, agreed.descriptor.num_tokens > 0, own, fields)
        if isinstance(own, Dispatch):  # this rank had a graph
            reason = EagerReason.OTHER_RANK if can_replay else EagerReason.NOT_CAPTURED
            return StepRoute(reason, False, own, fields)
        return StepRoute(own, False, own, fields)

    def _exchanged(self, row: StepRow) -> list[StepRow]:
        """Every rank's step row (one exchange); keeps every rank's token count for the eager forward."""
        rows = [StepRow.decode(ints) for ints in self.exchange(row.encode())]
        self._counts = tuple(row.num_tokens for row in rows)
        return rows

    def __repr__(self) -> str:
        return f"RankAgreement(rank={self._rank}, world_size={self._world_size}, backend={self._backend!r})"


class StepRow(NamedTuple):
    """One rank's row of a step's exchange, by name: its request, whether it can replay, an opaque field.

    ``can_replay``: every graph of the rank is captured. ``field``:
    ``FIELD_WIDTH`` ints for whoever drives the steps (the manager's
    lockstep capture), which the agreement carries and never reads.
    Exchanged as ``5 + FIELD_WIDTH`` ints, the invalid modes as a bit mask.
    """

    num_tokens: int
    uniform_decode: bool
    num_active_loras: int
    invalid_modes: frozenset[CUDAGraphMode]
    can_replay: bool
    field: tuple[int, ...]

    @classmethod
    def of(cls, request: RankRequest, can_replay: bool, field: Sequence[int]) -> StepRow:
        """``request``'s row, its ``field`` padded to ``FIELD_WIDTH`` (``ValueError`` if it is longer)."""
        if len(field) > FIELD_WIDTH:
            raise ValueError(f"field: at most {FIELD_WIDTH} ints, got {len(field)}: {tuple(field)!r:.80}")
        padded = (*field, *(0,) * (FIELD_WIDTH - len(field)))
        r = request
        return cls(r.num_tokens, r.uniform_decode, r.num_active_loras, r.invalid_modes, can_replay, padded)

    def encode(self) -> tuple[int, ...]:
        mask = 0
        for mode in self.invalid_modes:
            mask |= 1 << _MODES.index(mode)
        head = (self.num_tokens, int(self.uniform_decode), self.num_active_loras, mask, int(self.can_replay))
        return (*head, *self.field)

    @classmethod
    def decode(cls, ints: Sequence[int]) -> StepRow:
        num_tokens, uniform, loras, mask, can_replay, *field = ints
        invalid = frozenset(mode for i, mode in enumerate(_MODES) if mask >> i & 1) if mask else NO_MODES
        return cls(num_tokens, bool(uniform), loras, invalid, bool(can_replay), tuple(field))

    def request(self) -> RankRequest:
        return RankRequest(self.num_tokens, self.uniform_decode, self.num_active_loras, self.invalid_modes)


class StepRoute(NamedTuple):
    """What ``route_step`` returns: this rank's route, whether it is a dummy step, and the exchange's fields.

    ``own``: the route this rank would take alone (its planned graph, where
    it has one: what an eager step's reason names); ``fields``: every
    rank's opaque field in this step's exchange, by rank.
    """

    route: Route
    dummy: bool
    own: Route
    fields: tuple[tuple[int, ...], ...]


def _decided(dispatcher: CUDAGraphDispatcher, rows: Sequence[StepRow]) -> Dispatch:
    """``agree_step``'s decision from every rank's row: eager on all (unpadded) unless all can replay."""
    if not all(row.can_replay for row in rows):
        return Dispatch(_NONE, BatchDescriptor(max(row.num_tokens for row in rows)))
    return agree_across_ranks(dispatcher, [row.request() for row in rows])


def _agreement_group(
    group: dist.ProcessGroup | None, backend: Backend | None, timeout: datetime.timedelta | None
) -> tuple[dist.ProcessGroup, str]:
    """The group the exchanges run over, and its backend: ``group`` itself for ``backend=None``.

    Otherwise a new group of the same ranks (a collective over ``group``
    alone); shm's is a gloo group, which sets the shared table up. A subgroup
    synchronizes among its members only: the data-parallel groups of a
    DP x TP world each build theirs independently.
    """
    if backend is None:
        chosen = group if group is not None else dist.group.WORLD
        assert chosen is not None  # torch.distributed is initialized (checked)
        return chosen, str(dist.get_backend(chosen))
    ranks = None if group is None else dist.get_process_group_ranks(group)
    made = dist.new_group(
        ranks,
        backend="gloo" if backend == "shm" else backend,
        timeout=timeout,
        use_local_synchronization=ranks is not None,
    )
    return made, backend


def _exchange_device(backend: str, device: object, target: torch.device | None) -> torch.device:
    """Where the exchanges' tables live: ``target`` (``device`` resolved) for nccl, else the CPU.

    ``target`` is ``None`` where ``device`` was: nccl then takes the current CUDA device.
    """
    if backend != "nccl":
        if target is not None and target.type != "cpu":
            raise ValueError(
                f"device: backend {backend!r} exchanges on the CPU; a device is for backend='nccl', "
                f"got {device!r}"
            )
        return torch.device("cpu")
    resolved = resolve_device(None) if target is None else target
    if resolved.type != "cuda":
        shown = "None, and CUDA is not available here" if target is None else repr(device)
        raise ValueError(f"device: the nccl backend exchanges on a CUDA device, got {shown}")
    return resolved


def _check_row(row: object) -> None:
    """``exchange``'s ``row``: a list or tuple of 1+ ints that int64 holds (``ValueError`` naming it)."""
    if not isinstance(row, (list, tuple)) or not row:
        raise ValueError(f"row: expected a list or tuple of ints (one at least), got {row!r:.80}")
    for i, value in enumerate(row):
        if not isinstance(value, int) or isinstance(value, bool) or not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(
                f"row[{i}]: expected an int in the int64 range [-2**63, 2**63 - 1] (not a bool), "
                f"got {value!r:.80}"
            )


def _check_arguments(
    group: object, backend: object, device: torch.device | str | int | None, timeout: object
) -> torch.device | None:
    """``RankAgreement``'s arguments, each checked (``ValueError`` naming it), and torch.distributed up.

    Returns ``device`` resolved (``None`` for ``None``): checked for every
    backend, and against it where the backend is given.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group: expected a torch.distributed.ProcessGroup or None, got {group!r}")
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend: expected 'gloo', 'nccl', 'shm' or None, got {backend!r}")
    _check_available(backend)
    target = None if device is None else resolve_device(device)  # checks it, for every backend
    if backend is not None:
        _exchange_device(str(backend), device, target)  # raises where the backend cannot use it
    if timeout is not None and (
        not isinstance(timeout, datetime.timedelta) or not _TIMEOUTS[0] <= timeout <= _TIMEOUTS[1]
    ):
        raise ValueError(
            "timeout: expected a positive datetime.timedelta of 1 ms to 365 days (torch counts "
            f"milliseconds) or None, got {timeout!r}"
        )
    if backend is None and timeout is not None:
        raise ValueError(
            f"timeout: backend=None uses the group as it is, with its own timeout; got {timeout!r}"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "RankAgreement: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group on every rank first"
        )
    return target


def _check_available(backend: object) -> None:
    """``ValueError`` naming ``backend`` where this build of torch or this machine lacks it."""
    unsupported = shared_memory_supported() if backend == "shm" else None
    if unsupported is not None:
        raise ValueError(f"backend: 'shm' is not offered here: {unsupported}; use 'gloo' or 'nccl'")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError(
            f"backend: 'nccl' is not available in this build of torch ({torch.__version__}: "
            "torch.distributed.is_nccl_available() is False, as in CPU-only builds); use 'gloo' "
            "(or 'shm' between the ranks of one x86-64 host)"
        )
    if backend in ("gloo", "shm") and not dist.is_gloo_available():
        raise ValueError(
            f"backend: {backend!r} needs gloo, which this build of torch ({torch.__version__}) lacks "
            "(torch.distributed.is_gloo_available() is False); use 'nccl'"
        )
