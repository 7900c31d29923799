"""Ranks that capture together: one plan, the keys any of them misses, each key kept by all or by none.

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
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Collection, Sequence
from typing import Final, NamedTuple

from cudagraph_capture import CaptureError
from cudagraph_capture.lowlevel import capture_disabled_reason
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode

from .._graphs import GraphTable, PlannedGraph
from .._protocols import OutputT
from .._reports._report import CapturedGraph
from ..ranks import RankAgreement, RanksDisagreeError
from ._retry import worth_retrying

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
    true where every failed rank's error is worth retrying (``_retry``).
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
