"""What the parts of one manager share: built once, read by its steps, its captures and its loops.

Each fact has one owner here: the device is the static buffers' (where the
graphs read their inputs), the mode resolution the dispatcher's, why nothing
is captured (``no_graphs``) this object's. The parts read them from here and
keep no copy. The step lock (``StepLock``) is here too: one call at a time
holds the static buffers, and a call from inside that call is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Final, Generic

import torch

from cudagraph_dispatch import CUDAGraphDispatcher
from cudagraph_dispatch.support import ModeResolution

from ._arguments import Arguments
from ._memory._buffers import LoopBuffers, StaticBuffers
from ._memory._kv import KVCacheMemory
from ._memory._outputs import LayoutCell
from ._values._protocols import AttentionMetadataBuilder, OutputT
from ._values._reports import StepCounts
from .ranks import RankAgreement


class StepLock:
    """One call at a time holds a manager's static buffers; a call from inside that call is refused at once.

    ``acquire``, ``release`` and ``locked`` are the lock's own (C functions:
    the replay's path adds no Python call). ``owner``: the thread holding
    it (0: none), set by the holder right after acquiring and cleared right
    before releasing, so a thread that finds itself the owner is inside a
    call of this manager (its model, builder or advance calls back), where
    waiting would deadlock. ``capturing``: the thread of a background
    capture while it runs the model (it holds no lock: the steps go on).
    Another thread is told the manager is busy (``run``) or waits (the rest).
    """

    __slots__ = ("acquire", "capturing", "locked", "owner", "release")

    def __init__(self) -> None:
        lock = threading.Lock()
        self.acquire: Final = lock.acquire
        self.release: Final = lock.release
        self.locked: Final = lock.locked
        self.owner = 0
        self.capturing = 0

    def refused(self, what: str) -> RuntimeError:
        """The error of ``what()``, which found the lock taken (or runs on the background capture thread)."""
        me = threading.get_ident()
        if me == self.capturing:
            return RuntimeError(f"{what}(): {_INSIDE_CAPTURE}")
        if me == self.owner:
            return RuntimeError(f"{what}(): {_INSIDE_STEP}")
        return RuntimeError(f"CUDAGraphManager.{what}: {_BUSY}")

    @contextlib.contextmanager
    def held(self, what: str) -> Iterator[None]:
        """Hold the lock for ``what()``, waiting for another thread; refused at once from inside a call."""
        me = threading.get_ident()
        if me == self.owner or me == self.capturing:
            raise self.refused(what)
        self.acquire()
        self.owner = me
        try:
            yield
        finally:
            self.owner = 0
            self.release()

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """This thread runs the model for a background capture: its calls on the manager are refused."""
        self.capturing = threading.get_ident()
        try:
            yield
        finally:
            self.capturing = 0


_INSIDE_STEP: Final = (
    "called from inside a step of this manager (the model, attention builder or decode loop's advance "
    "that its run(), run_batch(), run_loop() or capture() is running); that call holds the static "
    "buffers, so this one would wait for itself: call it after that call returns"
)
_INSIDE_CAPTURE: Final = (
    "called from inside this manager's background capture (the model, attention builder or decode "
    "loop's advance, warmed up or recorded on the capture thread); the capture cannot wait for itself: "
    "call it from the serving thread"
)
_BUSY: Final = (
    "another thread is inside run(), capture(), clear(), start_capture(), release() or "
    "estimate_memory() of this manager; its static buffers serve one step at a time "
    "(serialize the calls, or use a manager per thread)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class ManagerParts(Generic[OutputT]):
    """A manager's model, dispatcher, static buffers, outputs' layout and counters, and its settings.

    ``no_graphs``: why the manager captures nothing (``None``: it captures);
    ``strict``: steps without a graph raise; ``ranks``: the ranks it steps
    with; ``builder``: the attention's metadata builder (``None``: the model
    builds its metadata itself); ``loop``: the decode loop's state, if any;
    ``lock``: the step lock; ``kv_cache``: the KV cache's reserved memory, if any.
    """

    model: Callable[..., OutputT]
    dispatcher: CUDAGraphDispatcher
    buffers: StaticBuffers
    layout: LayoutCell
    counts: StepCounts
    no_graphs: str | None
    strict: bool
    ranks: RankAgreement | None
    builder: AttentionMetadataBuilder[object] | None
    loop: LoopBuffers[OutputT] | None
    lock: StepLock
    kv_cache: KVCacheMemory | None

    @classmethod
    def of(
        cls, model: Callable[..., OutputT], checked: Arguments[OutputT], strict: bool
    ) -> ManagerParts[OutputT]:
        """A manager's parts from its ``checked`` arguments: a static buffer per input, fresh counters."""
        config = checked.dispatcher.config
        buffers = StaticBuffers(
            checked.inputs,
            max_tokens=config.capture_sizes.max,
            max_num_seqs=config.max_num_seqs,
            uniform_decode_query_len=config.uniform_decode_query_len,
            device=checked.device,
        )
        layout = LayoutCell(checked.rows)
        decode_loop = checked.given.decode_loop
        loop = None if decode_loop is None else LoopBuffers(decode_loop, config.max_num_seqs, checked.device)
        return cls(
            model,
            checked.dispatcher,
            buffers,
            layout,
            StepCounts(),
            checked.no_graphs,
            strict,
            checked.given.ranks,
            checked.builder,
            loop,
            StepLock(),
            checked.given.kv_cache,
        )

    @property
    def device(self) -> torch.device:
        """Where the static buffers live, and so every graph, step and loop of the manager."""
        return self.buffers.device

    @property
    def resolution(self) -> ModeResolution:
        """The mode the graphs follow (the dispatcher's), for the reports."""
        return self.dispatcher.resolution
