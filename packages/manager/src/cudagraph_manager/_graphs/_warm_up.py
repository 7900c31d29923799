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
invalidates the capture, ``_recording.worth_retrying``) is retried once after its
warm-up; the model's own errors and an out-of-memory are raised at once, as
under ``"every_key"``.
``"auto"`` (the default) is ``"per_class"`` while dynamo has compiled
nothing in this process and there are no ranks, and turns to
``"every_key"`` for the rest of a capture once anything compiles, unless
the attention says which shapes share compiled code (``compile_class``:
its ``compile_class(shape)``, part of the class): then a compiled model
warms once per compile class too, each class's first warm-up compiling its
code, and a recording that compiled anyway (a class the declaration missed)
is recorded again after its warm-up. The background capture uses
``capture()``'s warm-ups (``background``), all of them before its first recording.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Hashable, Iterator, Sequence
from typing import Final, Generic, Protocol, TypeAlias

from cudagraph_capture import CaptureError
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode

from .._compiled import dynamo_compiles
from .._options import WarmUpPolicy
from .._values._protocols import OutputT
from .._values._reports import CapturedGraph
from ._recording import worth_retrying
from ._table import PlannedGraph, by_mode

_logger: Final = logging.getLogger("cudagraph_manager")


@dataclasses.dataclass(frozen=True, slots=True)
class WarmUps:
    """The keys one capture warms up, in plan order, and those of them it may skip.

    ``skippable``: each mode's smallest key where its warm-up is not also the
    mode's largest; skipped on a thread that has its handles
    (``WarmUpRule.thread_has_handles``). Only a background capture skips.
    """

    keys: tuple[BatchDescriptor, ...]
    skippable: frozenset[BatchDescriptor]


#: What keys of one warm-up class share: everything but their sizes, and their compile class.
WarmUpClass: TypeAlias = tuple[CUDAGraphMode, bool, bool, int, Hashable]


def warm_up_class(graph: PlannedGraph[OutputT]) -> WarmUpClass:
    """``graph``'s class: its mode, uniform flag, LoRA fields and compile class (``compile_class``)."""
    d = graph.descriptor
    return (graph.mode, d.uniform, d.has_lora, d.num_active_loras, compile_class(graph))


def compile_class(graph: PlannedGraph[OutputT]) -> Hashable:
    """The attention's ``compile_class(shape)`` of ``graph``'s key (``None`` where it declares none).

    Shapes of one compile class share compiled code (a ``torch.compile``
    specialization, a kernel variant); a key of a class warmed up before
    records without compiling.
    """
    declared = getattr(getattr(graph, "builder", None), "compile_class", None)
    return None if declared is None else declared(graph.shape)


def declares_compile_classes(graphs: Sequence[PlannedGraph[OutputT]]) -> bool:
    """Whether the attention of ``graphs`` says which shapes share compiled code."""
    return any(getattr(getattr(g, "builder", None), "compile_class", None) is not None for g in graphs)


class Capture(Protocol):
    """A capturer's capture of one key: ``capture(descriptor, warm=...)``."""

    def __call__(self, descriptor: BatchDescriptor, /, *, warm: bool) -> CapturedGraph: ...


class Compiles:
    """What ``ForegroundWarmUps.watch`` saw over one capture: whether dynamo compiled during it."""

    __slots__ = ("compiled",)

    def __init__(self) -> None:
        self.compiled = False


class ForegroundWarmUps(Generic[OutputT]):
    """One ``capture()``'s warm-ups, decided key by key (``needs``) as the capture goes.

    ``every``: the keys ``"every_key"`` warms; ``chosen``: the keys this
    capture's policy warms (the same set, or each class's first and each
    mode's smallest). ``watch`` counts dynamo's compiles over one key's
    capture. ``declared``: the attention declares compile classes, so a
    class's first warm-up is expected to compile, and nothing else is.
    """

    __slots__ = ("_auto", "_chosen", "_declared", "_every", "_hot", "_warmed")

    def __init__(
        self,
        every: Sequence[BatchDescriptor],
        chosen: Sequence[BatchDescriptor],
        *,
        auto: bool,
        declared: bool = False,
    ) -> None:
        self._every: Final = frozenset(every)
        self._chosen = frozenset(chosen)
        self._auto: Final = auto
        self._declared: Final = declared
        self._hot: Final[set[WarmUpClass]] = set()  # classes whose last capture compiled
        self._warmed: Final[set[WarmUpClass]] = set()  # classes a key of which warmed up in this capture

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
        make: an autotune's or a compile's synchronization). A cold recording
        during which dynamo compiled (a compile class the attention did not
        declare) is recorded again after its warm-up: nothing compiles inside
        a recording that is kept.
        """
        warm = self.needs(graph)
        try:
            with self.watch(graph, warm=warm) as seen:
                captured = capture(graph.descriptor, warm=warm)
        except CaptureError as error:
            cold = not warm and graph.descriptor in self._every  # cold by the class rule
            if not cold or not (seen.compiled or worth_retrying(error)):
                raise  # "every_key" warms it; the model's own error, an out-of-memory: raised at once
        else:
            if warm or not seen.compiled:
                return captured
            _logger.warning(
                "the capture of %s compiled inside its recording (a shape class the attention's "
                "compile_class did not declare): recorded again after its warm-up",
                graph.descriptor,
            )
        hot = warm_up_class(graph) in self._hot  # the cold try compiled: the class stays hot
        with self.watch(graph, warm=True):
            captured = capture(graph.descriptor, warm=True)
        if hot:
            self._hot.add(warm_up_class(graph))
        return captured

    @contextlib.contextmanager
    def watch(self, graph: PlannedGraph[OutputT], *, warm: bool = False) -> Iterator[Compiles]:
        """Around ``graph``'s capture (``warm``: with its warm-up): where dynamo compiled, its class's next
        key warms up too, unless this was the first warm-up of a declared compile class (expected).

        Under ``"auto"`` without declared classes a compile shows a compiled
        model: every key from here.
        """
        before = dynamo_compiles()
        seen = Compiles()
        try:
            yield seen
        finally:
            cls = warm_up_class(graph)
            after = dynamo_compiles()
            seen.compiled = after is not None and after > (before or 0)
            expected = warm and self._declared and cls not in self._warmed
            if seen.compiled and not expected:
                self._hot.add(cls)
                if self._auto:
                    self._chosen = self._every
            elif not seen.compiled:
                self._hot.discard(cls)
            if warm:
                self._warmed.add(cls)


class WarmUpRule(Generic[OutputT]):
    """One manager's rule for ``capture()``, the background capture and the estimate, and its memory.

    Remembers the keys warmed up (with the seconds of a warm-up not yet
    counted in a report) and, per thread, whether it warmed up for this
    manager.
    """

    __slots__ = ("_seconds", "_threads")

    def __init__(self) -> None:
        #: Keys warmed up once, with the seconds of a warm-up not yet counted in a report.
        self._seconds: Final[dict[BatchDescriptor, float]] = {}
        #: The threads that warmed up for the manager (weakly: an ended thread's ident may be reused).
        self._threads: Final[weakref.WeakSet[threading.Thread]] = weakref.WeakSet()

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

    def for_capture(
        self, pending: Sequence[PlannedGraph[OutputT]], policy: WarmUpPolicy, *, ranks: bool
    ) -> ForegroundWarmUps[OutputT]:
        """``capture()``'s warm-ups under ``policy`` (``"auto"`` resolved here: see the module)."""
        every = self.foreground(pending, ranks=ranks).keys
        auto = policy == "auto"
        declared = declares_compile_classes(pending)
        if ranks or policy == "every_key" or (auto and not declared and dynamo_compiles()):
            return ForegroundWarmUps(every, every, auto=False, declared=declared)
        chosen = self.per_class(pending)
        return ForegroundWarmUps(every, chosen, auto=auto and not declared, declared=declared)

    def per_class(
        self, pending: Sequence[PlannedGraph[OutputT]], *, smallest: bool = True
    ) -> tuple[BatchDescriptor, ...]:
        """Each class's first key where no key of the class was warmed up before, and each mode's smallest.

        ``smallest=False``: the classes' first keys alone (each a first use).
        """
        smallest_keys = smallest_of_modes(pending) if smallest else frozenset()
        warmed = {warm_up_class(graph) for graph in pending if graph.descriptor in self._seconds}
        keys: list[BatchDescriptor] = []
        for graph in pending:
            cls = warm_up_class(graph)
            if cls not in warmed:
                warmed.add(cls)
                keys.append(graph.descriptor)
            elif graph.descriptor in smallest_keys:
                keys.append(graph.descriptor)
        return tuple(keys)

    def background(self, pending: Sequence[PlannedGraph[OutputT]], policy: WarmUpPolicy) -> WarmUps:
        """A capture thread's: ``capture()``'s warm-ups under ``policy`` (``for_capture``), at its start.

        Per class: each class's first key not warmed before (its compile class
        included) and each mode's smallest; every key's first use where
        ``capture()`` would warm every key. A mode's smallest that warms up
        only for the thread's handles is ``skippable``. The rest warm up
        nowhere: the serving thread's eager steps used them (the keys a wake
        misses first are captured first).
        """
        warm_ups = self.for_capture(pending, policy, ranks=False)
        keys = tuple(graph.descriptor for graph in pending if warm_ups.needs(graph))
        first_uses = set(self.per_class(pending, smallest=False)) if warm_ups.per_class else set()
        if not warm_ups.per_class:
            first_uses = {d for d in keys if d not in self._seconds}
        skippable = frozenset(d for d in smallest_of_modes(pending) if d in keys and d not in first_uses)
        return WarmUps(keys, skippable)

    def thread_has_handles(self, *, weights_kept: bool = False) -> bool:
        """Whether a skippable warm-up is skipped here: this thread warmed up for the manager before.

        Where dynamo is loaded, only with ``weights_kept`` (``WeightWatch.kept``: the same
        tensors as the last graphs read): a compiled model may recompile after new weights.
        """
        if not self.warmed_on(threading.current_thread()):
            return False
        return weights_kept or dynamo_compiles() is None

    def warmed_on(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` warmed up for the manager (its library handles, plans and lazy state)."""
        return thread in self._threads

    def thread_warmed(self) -> None:
        """This thread warmed the manager's keys up (each mode's smallest); their seconds are not reported."""
        self._threads.add(threading.current_thread())

    def ran(self, descriptor: BatchDescriptor, seconds: float) -> None:
        """A warm-up of ``descriptor`` ran on this thread and took ``seconds``, not yet reported."""
        self._seconds[descriptor] = seconds
        self.thread_warmed()

    def warmed_classes(self, pending: Sequence[PlannedGraph[OutputT]]) -> frozenset[WarmUpClass]:
        """The warm-up classes of ``pending`` a key of which was warmed up before (their first use made)."""
        return frozenset(warm_up_class(graph) for graph in pending if graph.descriptor in self._seconds)

    def unreported(self, descriptor: BatchDescriptor) -> float:
        """The seconds of a warm-up of ``descriptor`` run earlier and not yet in a report (0: none)."""
        return self._seconds.get(descriptor, 0.0)

    def captured(self, descriptor: BatchDescriptor) -> None:
        """``descriptor`` is captured: its first use is behind it, its warm-up counted in a report."""
        self._seconds[descriptor] = 0.0


def smallest_of_modes(graphs: Sequence[PlannedGraph[OutputT]]) -> frozenset[BatchDescriptor]:
    """Each mode's smallest key (a plan is largest first): warmed by every capture, for the thread."""
    return frozenset(of_mode[-1].descriptor for of_mode in by_mode(graphs).values())
