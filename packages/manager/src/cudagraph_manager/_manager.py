"""Model-level CUDA graphs: ``CUDAGraphManager``, the facade over the package's layers.

It builds its parts once from the checked arguments (``build_parts``; then
the graph table, the captures, the step plans and the step path:
docs/design.md, "Layers") and holds the step lock: one call at a time uses
the static buffers. A step is ``_steps/_path``'s ``StepPath.run``:

    check the inputs -> route -> build the metadata -> copy in -> entry.replay() -> count and cut

or, where the route has no captured graph (and with ranks, every step), the
step its plan says (``_steps/_plan``): an eager step counted per reason, an
idle step, an idle rank's dummy step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from threading import get_ident
from types import MappingProxyType
from typing import Final, Generic

import torch
from torch import Tensor

from cudagraph_capture.lowlevel import OutputGuard
from cudagraph_dispatch import CUDAGraphDispatcher, CUDAGraphMode, DispatchConfig
from cudagraph_dispatch.lowlevel import NO_MODES, check_bool

from ._graphs._capturer import Capturer
from ._graphs._lockstep import keys_to_capture
from ._graphs._table import GraphTable
from ._graphs._thread import check_keys_per_step
from ._memory._kv import KVCacheMemory
from ._options import ManagerOptions
from ._parts import build_parts
from ._steps._loop import LoopSteps
from ._steps._path import StepPath
from ._steps._plan import Planner
from ._values._inputs import StaticInput
from ._values._loop import LoopResult
from ._values._protocols import BackgroundCapture, OutputT
from ._values._reports import CaptureReport, ManagerStats, MemoryEstimate


class CUDAGraphManager(Generic[OutputT]):
    """Captures a model's forward as CUDA graphs and replays them, one call per step.

    ``model`` takes the ``inputs`` as keywords and returns a tensor or a flat
    tuple, list or dict of tensors; each input gets a static buffer on
    ``device`` (default: the current CUDA device, else the CPU: steps run
    eagerly). ``config`` decides which graphs exist; ``strict`` raises
    ``NoGraphError`` where a step would run eagerly; ``options``: the rest
    (``ManagerOptions``). One call at a time (``RuntimeError`` otherwise; from inside one, at once).
    """

    def __init__(
        self,
        model: Callable[..., OutputT],
        inputs: Mapping[str, StaticInput],
        config: DispatchConfig,
        *,
        device: torch.device | str | int | None = None,
        strict: bool = False,
        options: ManagerOptions[OutputT] | None = None,
    ) -> None:
        parts = self._parts = build_parts(model, inputs, config, device, strict, options)
        self._table: Final = GraphTable[OutputT](parts.dispatcher, parts.buffers, parts.builder)
        self._capturer: Final = Capturer(parts, self._table, weakref.WeakMethod(self._idle_step))
        self._weights: Final = self._capturer.weights  # the tensors the graphs read
        self._guard: Final = _output_guard() if parts.options.check_overwritten_outputs else None
        # The step plans: with ranks, the lockstep capture's field and turn ride on every step's exchange.
        planner = Planner(parts, self._table, self._capturer)
        self._path: Final = StepPath(parts, self._table, planner, self._weights, self._guard)
        loop = parts.loop
        steps = None if loop is None else LoopSteps(parts, loop, self._path, planner)
        self._loops: Final = steps
        self._lock: Final = parts.lock  # one call at a time; a call from inside one is refused

    # -- accessors --

    @property
    def device(self) -> torch.device:
        return self._parts.device

    @property
    def dispatcher(self) -> CUDAGraphDispatcher:
        """The dispatcher built from ``config``: the graphs that exist are its keys."""
        return self._parts.dispatcher

    @property
    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        """The static input buffers by name (read-only mapping; the tensors are the live buffers)."""
        return MappingProxyType({b.name: b.tensor for b in self._parts.buffers.buffers})

    @property
    def busy(self) -> bool:
        """Whether a call of this manager holds its static buffers now (a ``run`` would raise)."""
        return self._lock.locked()

    @property
    def num_captured(self) -> int:
        """How many keys of the capture plan have a captured graph."""
        return self._table.num_captured

    @property
    def stats(self) -> ManagerStats:
        """A snapshot of what the steps did since construction or ``reset_stats``."""
        kv_cache = self._parts.kv_cache
        backing = None if kv_cache is None else kv_cache.backing()
        return self._parts.counts.snapshot(self._table.replays_by_size(), self._parts.resolution, backing)

    def reset_stats(self) -> None:
        self._table.reset_replays()
        self._parts.counts.reset()

    # -- graphs --

    def capture(self, *, progress: bool | None = None) -> CaptureReport:
        """Capture the plan's pending keys (PIECEWISE, then FULL, largest first); synchronizes once.

        ``progress``: a tqdm bar (default: when stderr is a terminal). With ranks, a collective that
        captures the keys any rank misses, on every rank. Raises ``CaptureError`` naming the key; the
        keys before it stay captured.
        """
        if progress is not None:
            check_bool("progress", progress)
        with self._exclusive("capture"):
            parts = self._parts
            keys = keys_to_capture(parts.ranks, self._table, parts.no_graphs)
            self._capturer.begin(keys)
            return self._capturer.foreground(keys, parts.ranks, progress)

    def estimate_memory(self) -> MemoryEstimate:
        """What ``capture()`` of the pending keys will cost the device, from probes; synchronizes."""
        with self._exclusive("estimate_memory"):
            parts = self._parts
            keys = keys_to_capture(parts.ranks, self._table, parts.no_graphs)
            return self._capturer.estimate(keys, parts.ranks)

    def start_capture(self, *, keys_per_step: int = 1) -> BackgroundCapture:
        """Capture the pending keys in a thread while ``run()`` keeps serving; call it on the serving stream.

        A key's steps run eagerly as ``not_captured`` until its capture (allowed when ``strict``).
        With ranks: the steps capture ``keys_per_step`` keys each, every rank the keys any rank misses
        (no thread; docs/design.md, "With ranks").
        """
        check_keys_per_step(keys_per_step, self._parts.ranks is not None)
        with self._exclusive("start_capture"):
            pending = self._table.pending()
            self._capturer.begin(pending)
            return self._capturer.background(pending, keys_per_step)

    def clear(self) -> None:
        """Free every captured graph (the pool stays usable); ``capture()`` captures them anew."""
        with self._exclusive("clear"):
            self._capturer.drop_all()

    def release(self) -> None:
        """Free every graph, give its memory back (a sleep): the last outputs die, steps run eagerly."""
        with self._lock.held("release"):
            if self._guard is not None:
                self._guard.retire_all()
            self._capturer.release()  # stops a background capture first, gives the memory back last

    # -- the KV cache (``ManagerOptions.kv_cache``) --

    def back_kv_cache(
        self,
        *,
        margin_bytes: int | None = None,
        units: int | None = None,
        in_use: Iterable[int] | torch.Tensor | None = None,
    ) -> int:
        """Back the KV cache's reservation; the units it backs now (what the engine may hand out).

        ``margin_bytes``: grow it by the device's free memory beyond the
        margin, measured now (after the capture: torch's unused cache given
        back first), so that what stays free is the margin to within one
        chunk. ``units``: back exactly that many (at least; growing needs the
        memory free, shrinking the ids ``in_use``, none of them at or past
        ``units``). One of the two. Refused while a background capture runs;
        nothing changes where it raises. No graph is captured again.
        """
        kv_cache = self._kv_cache("back_kv_cache")
        if (margin_bytes is None) == (units is None):
            raise ValueError(
                f"margin_bytes, units: expected one of them, got margin_bytes={margin_bytes!r:.40} and "
                f"units={units!r:.40}"
            )
        with self._exclusive("back_kv_cache"):
            if margin_bytes is not None:
                if in_use is not None:
                    raise ValueError("in_use: only a shrink (units=...) takes the units in use")
                return kv_cache.back_from_free(margin_bytes)
            assert units is not None
            return kv_cache.back(units, in_use=in_use)

    def drop_kv_cache(self) -> int:
        """Give the KV cache's memory back but its ``min_units`` (a sleep that keeps the graphs).

        What the cache held is gone; ``back_kv_cache`` backs it again (the
        wake), and the graphs replay against it as before. Steps meanwhile
        may name only the units still backed. Synchronizes the device.
        """
        kv_cache = self._kv_cache("drop_kv_cache")
        with self._exclusive("drop_kv_cache"):
            return kv_cache.drop()

    def _kv_cache(self, what: str) -> KVCacheMemory:
        kv_cache = self._parts.kv_cache
        if kv_cache is None:
            raise RuntimeError(f"{what}: this manager was built without ManagerOptions(kv_cache=...)")
        return kv_cache

    def check_weights(self) -> None:
        """Raise ``WeightsReplacedError`` if a tensor the captured graphs read was replaced."""
        self._weights.check()

    def _idle_step(self) -> None:
        """A step of 0 tokens on this rank (a lockstep capture's ``wait()``): its exchange, and its turn."""
        with self._lock.held("wait"):
            self._path.idle_step()

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Hold the step lock (waiting for another thread's call); refuse while a background capture runs."""
        with self._lock.held(what):
            if self._capturer.running() is not None:
                raise RuntimeError(f"{what}: a background capture of this manager is running; wait() for it")
            yield

    # -- steps --

    def run(
        self,
        /,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
        **inputs: torch.Tensor,
    ) -> OutputT:
        """One step: its graph replayed on the padded batch, or the model run eagerly.

        Returns the outputs cut to the real rows: views of graph memory, valid
        until the next ``run`` or ``run_loop``. Raises ``ValueError`` naming a
        bad input before a buffer is touched; ``NoGraphError`` if ``strict``.
        """
        lock = self._lock
        if (me := get_ident()) == lock.capturing or not lock.acquire(False):
            raise lock.refused("run")  # the background capture's thread, another thread, or from inside
        try:
            lock.owner = me
            return self._path.run(inputs, uniform_decode, num_active_loras, invalid_modes)
        finally:
            lock.owner = 0
            lock.release()

    def run_batch(
        self,
        inputs: Mapping[str, torch.Tensor],
        /,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
    ) -> OutputT:
        """``run`` with the inputs in one mapping (mypy rejects ``run(**batch)`` of a dict)."""
        given: object = inputs
        if given.__class__ is not dict and not isinstance(given, Mapping):
            raise ValueError(f"{_NOT_A_MAPPING}, got {type(given).__name__}")
        lock = self._lock
        if (me := get_ident()) == lock.capturing or not lock.acquire(False):
            raise lock.refused("run_batch")
        try:
            lock.owner = me
            return self._path.run(inputs, uniform_decode, num_active_loras, invalid_modes)
        finally:
            lock.owner = 0
            lock.release()

    def run_loop(
        self,
        batch: Mapping[str, torch.Tensor] | None = None,
        /,
        *,
        max_steps: int | None = None,
        **inputs: Tensor,
    ) -> LoopResult:
        """Up to ``max_steps`` decode steps of a uniform batch (keywords or ``batch``); synchronizes once.

        ``LoopResult.tokens`` is valid until the next ``run_loop``, capture or ``estimate_memory()``.
        """
        if self._loops is None:
            raise RuntimeError("run_loop: this manager was built without ManagerOptions(decode_loop=...)")
        lock = self._lock
        if (me := get_ident()) == lock.capturing or not lock.acquire(False):
            raise lock.refused("run_loop")
        try:
            lock.owner = me
            return self._loops.run(batch, inputs, max_steps)
        finally:
            lock.owner = 0
            lock.release()


_NOT_A_MAPPING: Final = "inputs: expected a mapping of input names to tensors"


def _output_guard() -> OutputGuard:
    """``OutputGuard()``, its error naming the manager's argument that asked for it."""
    try:
        return OutputGuard()
    except ValueError as error:
        raise ValueError(f"options.check_overwritten_outputs: {error}") from None
