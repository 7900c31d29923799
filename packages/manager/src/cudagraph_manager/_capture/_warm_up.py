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

``capture()``'s policy (``ManagerOptions.warm_ups``): ``"every_key"`` warms
each key's first use up; ``"per_class"`` only each class's (``warm_up_class``:
the mode, the uniform flag, the LoRA fields; every size alike), as the
background capture already does: a recording pays a new size's host-side
first use itself (library heuristics, views), and the class's warm-up made
the rest (handles, workspaces, lazy state, compiles). Where a capture made
dynamo compile, the class's next key warms up too (a compiled model
specializes by size); a recording of a key not warmed up that fails as a
first use does inside a capture (a synchronization, a library handle: CUDA
invalidates the capture, ``_retry.worth_retrying``) is retried once after its
warm-up; the model's own errors and an out-of-memory are raised at once, as
under ``"every_key"``.
``"auto"`` (the default) is ``"per_class"`` while dynamo has compiled
nothing in this process and there are no ranks, and turns to
``"every_key"`` for the rest of a capture once anything compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Final, Generic, Protocol, TypeAlias

from cudagraph_capture import CaptureError
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode

from .._compiled import dynamo_compiles
from .._graphs import PlannedGraph, by_mode
from .._options import WarmUpPolicy
from .._protocols import OutputT
from .._reports._report import CapturedGraph
from ._retry import worth_retrying


@dataclasses.dataclass(frozen=True, slots=True)
class WarmUps:
    """The keys one capture warms up, in plan order, and those of them it may skip.

    ``skippable``: each mode's smallest key where its warm-up is not also the
    mode's largest; skipped on a thread that has its handles
    (``WarmUpRule.thread_has_handles``). Only a background capture skips.
    """

    keys: tuple[BatchDescriptor, ...]
    skippable: frozenset[BatchDescriptor]


#: What keys of one warm-up class share: everything but their sizes.
WarmUpClass: TypeAlias = tuple[CUDAGraphMode, bool, bool, int]


def warm_up_class(graph: PlannedGraph[OutputT]) -> WarmUpClass:
    """``graph``'s class: its mode, uniform flag and LoRA fields (keys that differ only in size)."""
    d = graph.descriptor
    return (graph.mode, d.uniform, d.has_lora, d.num_active_loras)


class Capture(Protocol):
    """A capturer's capture of one key: ``capture(descriptor, warm=...)``."""

    def __call__(self, descriptor: BatchDescriptor, /, *, warm: bool) -> CapturedGraph: ...


class ForegroundWarmUps(Generic[OutputT]):
    """One ``capture()``'s warm-ups, decided key by key (``needs``) as the capture goes.

    ``every``: the keys ``"every_key"`` warms; ``chosen``: the keys this
    capture's policy warms (the same set, or each class's first and each
    mode's smallest). ``watch`` counts dynamo's compiles over one key's capture.
    """

    __slots__ = ("_auto", "_chosen", "_every", "_hot")

    def __init__(
        self, every: Sequence[BatchDescriptor], chosen: Sequence[BatchDescriptor], *, auto: bool
    ) -> None:
        self._every: Final = frozenset(every)
        self._chosen = frozenset(chosen)
        self._auto: Final = auto
        self._hot: Final[set[WarmUpClass]] = set()  # classes whose last capture compiled

    @property
    def per_class(self) -> bool:
        """Whether some key left records without its own warm-up (until ``"auto"`` sees a compile)."""
        return self._chosen != self._every

    def needs(self, graph: PlannedGraph[OutputT]) -> bool:
        """Whether ``graph`` warms up before its recording."""
        return graph.descriptor in self._chosen or warm_up_class(graph) in self._hot

    def capture(self, graph: PlannedGraph[OutputT], capture: Capture) -> CapturedGraph:
        """``graph`` captured, warmed up where ``needs``; a recording cold by the class rule retried once.

        The retry warms the key up first (a first use a recording cannot
        make: an autotune's or a compile's synchronization).
        """
        warm = self.needs(graph)
        try:
            with self.watch(graph):
                return capture(graph.descriptor, warm=warm)
        except CaptureError as error:
            if warm or graph.descriptor not in self._every or not worth_retrying(error):
                raise  # only a key cold by the class rule is retried ("every_key" warms it), for a first use
        with self.watch(graph):
            return capture(graph.descriptor, warm=True)

    @contextlib.contextmanager
    def watch(self, graph: PlannedGraph[OutputT]) -> Iterator[None]:
        """Around ``graph``'s capture: where dynamo compiled, its class's next key warms up too.

        Under ``"auto"`` a compile shows a compiled model: every key from here.
        """
        before = dynamo_compiles()
        try:
            yield
        finally:
            cls = warm_up_class(graph)
            after = dynamo_compiles()
            if after is not None and after > (before or 0):
                self._hot.add(cls)
                if self._auto:
                    self._chosen = self._every
            else:
                self._hot.discard(cls)


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
        return WarmUps(tuple(keys), frozenset())

    def plan(
        self, pending: Sequence[PlannedGraph[OutputT]], policy: WarmUpPolicy, *, ranks: bool
    ) -> ForegroundWarmUps[OutputT]:
        """``capture()``'s warm-ups under ``policy`` (``"auto"`` resolved here: see the module)."""
        every = self.foreground(pending, ranks=ranks).keys
        auto = policy == "auto"
        if ranks or policy == "every_key" or (auto and dynamo_compiles()):
            return ForegroundWarmUps(every, every, auto=False)
        return ForegroundWarmUps(every, self.per_class(pending), auto=auto)

    def per_class(self, pending: Sequence[PlannedGraph[OutputT]]) -> tuple[BatchDescriptor, ...]:
        """Each class's first key where no key of the class was warmed up before, and each mode's smallest."""
        smallest = smallest_of_modes(pending)
        warmed = {warm_up_class(graph) for graph in pending if graph.descriptor in self._seconds}
        keys: list[BatchDescriptor] = []
        for graph in pending:
            cls = warm_up_class(graph)
            if cls not in warmed:
                warmed.add(cls)
                keys.append(graph.descriptor)
            elif graph.descriptor in smallest:
                keys.append(graph.descriptor)
        return tuple(keys)

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
