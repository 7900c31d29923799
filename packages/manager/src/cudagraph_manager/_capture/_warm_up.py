"""The warm-up rule: which keys a capture runs eagerly before recording, for every kind of capture.

A key's first use precedes its recording: a compile for its size (a compile
inside a recording fails), library plans for its shapes (cuDNN's attention
builds one per shape, slower inside a capture), its eager allocator blocks.
A key this manager warmed up before (a recapture after ``clear()``, or
``release()`` and a wake, new weights or not) has them all. Each mode's
smallest key (``smallest_of_modes``) is warmed by every capture: on a thread
new to the manager it creates the thread's cuBLAS handles, which a recording
cannot (a wake without it fails with ``CUBLAS_STATUS_NOT_INITIALIZED``), and
new weights may make a compiled model recompile (one compile serves every
size of a dynamic graph). Only a background capture on a thread that has its
handles skips it, and where dynamo is loaded only if the graphs read the same
tensors as the last ones did (a wake with the weights kept: no guard changed).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Final, Generic

from cudagraph_dispatch import BatchDescriptor

from .._compiled import dynamo_compiles
from .._graphs import PlannedGraph, by_mode
from .._protocols import OutputT


@dataclasses.dataclass(frozen=True, slots=True)
class WarmUps:
    """The keys one capture warms up, in plan order, and those of them it may skip.

    ``skippable``: each mode's smallest key where its warm-up is not also the
    mode's largest; skipped on a thread that has its handles
    (``WarmUpRule.thread_has_handles``). Only a background capture skips.
    """

    keys: tuple[BatchDescriptor, ...]
    skippable: frozenset[BatchDescriptor]
    #: With ranks: every rank runs the same warm-ups (a tensor-parallel one holds collectives), so
    #: the estimate warms up each of two eager twins (``_estimate.eager_twin``), not one for both.
    ranks: bool = False


class WarmUpRule(Generic[OutputT]):
    """One manager's rule for ``capture()``, the background capture and the estimate, and its memory.

    Remembers the keys warmed up (with the seconds of a warm-up not yet
    counted in a report) and, per thread, whether it warmed up for this
    manager.
    """

    __slots__ = ("_seconds", "_thread")

    def __init__(self) -> None:
        #: Keys warmed up once, with the seconds of a warm-up not yet counted in a report.
        self._seconds: Final[dict[BatchDescriptor, float]] = {}
        self._thread: Final = threading.local()  # ``warmed``: this thread warmed up for the manager

    def foreground(self, pending: Sequence[PlannedGraph[OutputT]], *, ranks: bool) -> WarmUps:
        """``capture()``'s (and the estimate's): each key's first use and each mode's smallest.

        With ``ranks``, every key: a tensor-parallel warm-up holds
        collectives, so every rank runs the same ones, whatever it warmed before.
        """
        smallest = smallest_of_modes(pending)
        keys = [graph.descriptor for graph in pending]
        if not ranks:
            keys = [d for d in keys if d not in self._seconds or d in smallest]
        return WarmUps(tuple(keys), frozenset(), ranks=ranks)

    def background(self, pending: Sequence[PlannedGraph[OutputT]]) -> WarmUps:
        """The background capture's: each mode's largest key not warmed before, and its smallest.

        The rest warm up nowhere: the serving thread's eager steps used them
        (the keys a wake misses first are captured first).
        """
        keys: dict[BatchDescriptor, None] = {}
        skippable: set[BatchDescriptor] = set()
        for of_mode in by_mode(pending).values():
            first, last = of_mode[0].descriptor, of_mode[-1].descriptor
            largest = () if first in self._seconds else (first,)
            keys |= dict.fromkeys((*largest, last))
            if last not in largest:
                skippable.add(last)
        return WarmUps(tuple(keys), frozenset(skippable))

    def thread_has_handles(self, *, weights_kept: bool = False) -> bool:
        """Whether a skippable warm-up is skipped here: this thread warmed up for the manager before.

        Where dynamo is loaded, only with ``weights_kept`` (``WeightWatch.kept``: the same
        tensors as the last graphs read): a compiled model may recompile after new weights.
        """
        if not getattr(self._thread, "warmed", False):
            return False
        return weights_kept or dynamo_compiles() is None

    def ran(self, descriptor: BatchDescriptor, seconds: float) -> None:
        """A warm-up of ``descriptor`` ran on this thread and took ``seconds``, not yet reported."""
        self._seconds[descriptor] = seconds
        self._thread.warmed = True

    def unreported(self, descriptor: BatchDescriptor) -> float:
        """The seconds of a warm-up of ``descriptor`` run earlier and not yet in a report (0: none)."""
        return self._seconds.get(descriptor, 0.0)

    def captured(self, descriptor: BatchDescriptor) -> None:
        """``descriptor`` is captured: its first use is behind it, its warm-up counted in a report."""
        self._seconds[descriptor] = 0.0


def smallest_of_modes(graphs: Sequence[PlannedGraph[OutputT]]) -> frozenset[BatchDescriptor]:
    """Each mode's smallest key (a plan is largest first): warmed by every capture, for the thread."""
    return frozenset(of_mode[-1].descriptor for of_mode in by_mode(graphs).values())
