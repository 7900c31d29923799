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

from cudagraph_capture._guard import OutputGuard
from cudagraph_dispatch import CUDAGraphDispatcher, CUDAGraphMode, DispatchConfig
from cudagraph_dispatch._request import NO_MODES
from cudagraph_dispatch.lowlevel import check_bool

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

    Args:
        model: called with the inputs as keywords; returns a tensor or a flat
            tuple, list or dict of tensors (``ModelOutput``).
        inputs: the model's inputs by name, each a ``StaticInput``: each gets a
            static buffer on ``device``, allocated here.
        config: which graphs exist (the keys of the dispatcher it builds).
        device: where the buffers and the graphs live (default: the current
            CUDA device, else the CPU, where every step runs eagerly).
        strict: raise ``NoGraphError`` where a step would run without a graph.
        options: everything else (``ManagerOptions``).

    Raises:
        ValueError: naming the first bad argument, before anything is allocated.
        ModeNotSupportedError: the config's mode needs more than the attention
            supports, where ``AttentionOptions(strict=True)`` says so.

    One call at a time holds the static buffers: ``run`` (and ``run_batch``,
    ``run_loop``) raises ``RuntimeError`` while another thread's call holds
    them, the other calls wait; a call from inside one (the model, an
    attention builder or a decode loop's advance, calling back) raises at once.
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
        parts = self._parts
        return parts.counts.snapshot(self._table.replays_by_size(), parts.resolution, parts.kv_backing())

    def reset_stats(self) -> None:
        """Start the counts of ``stats`` again from zero (the graphs stay)."""
        self._table.reset_replays()
        self._parts.counts.reset()

    # -- graphs --

    def capture(self, *, progress: bool | None = None) -> CaptureReport:
        """Capture the plan's pending keys (PIECEWISE, then FULL, largest first); synchronizes once.

        With ranks, a collective: every rank captures the keys any rank misses.

        Args:
            progress: show a tqdm bar (default: when stderr is a terminal).

        Returns:
            What the capture did: each graph's seconds and bytes, and the totals.

        Raises:
            CaptureError: naming the key that failed; the keys before it stay captured.
            WeightsReplacedError: a tensor the graphs kept read was replaced.
            RanksDisagreeError: with ranks, where they plan different keys or
                one cannot capture (on every rank, before any capture).
            RuntimeError: a background capture of this manager is running.
        """
        if progress is not None:
            check_bool("progress", progress)
        with self._exclusive("capture"):
            parts = self._parts
            keys = keys_to_capture(parts.ranks, self._table, parts.no_graphs)
            self._capturer.begin(keys)
            return self._capturer.foreground(keys, parts.ranks, progress)

    def estimate_memory(self) -> MemoryEstimate:
        """What ``capture()`` of the pending keys will cost the device, from probes; synchronizes.

        The probes are captured into a pool of their own and freed again.

        Returns:
            The prediction (0, and why, where nothing would be captured).

        Raises:
            CaptureDisabledError: captures are turned off (``set_capture_enabled``).
            RanksDisagreeError: with ranks, as ``capture()``.
            RuntimeError: a background capture of this manager is running.
        """
        with self._exclusive("estimate_memory"):
            parts = self._parts
            keys = keys_to_capture(parts.ranks, self._table, parts.no_graphs)
            return self._capturer.estimate(keys, parts.ranks)

    def start_capture(self, *, keys_per_step: int = 1) -> BackgroundCapture:
        """Capture the pending keys in a thread while ``run()`` keeps serving; call it on the serving stream.

        A key's steps run eagerly as ``not_captured`` until its capture
        (allowed when ``strict``). With ranks there is no thread: the steps
        capture, every rank the keys any rank misses (docs/design.md,
        "With ranks").

        Args:
            keys_per_step: with ranks, the keys one step captures.

        Returns:
            The capture's handle (``BackgroundCapture``: ``progress``,
            ``errors``, ``wait()``, ``stop()``), once its warm-ups are queued.

        Raises:
            ValueError: ``keys_per_step`` is no int >= 1, or not 1 without ranks.
            WeightsReplacedError: a tensor the graphs kept read was replaced.
            RuntimeError: another background capture of this manager is
                running, or the call came on the capture stream.
        """
        check_keys_per_step(keys_per_step, self._parts.ranks is not None)
        with self._exclusive("start_capture"):
            pending = self._table.pending()
            self._capturer.begin(pending)
            return self._capturer.background(pending, keys_per_step)

    def clear(self) -> None:
        """Free every captured graph (the pool stays usable); ``capture()`` captures them anew.

        Raises:
            RuntimeError: a background capture of this manager is running.
        """
        with self._exclusive("clear"):
            self._capturer.drop_all()

    def release(self) -> None:
        """Free every graph and give its memory back (a sleep): the last outputs die, steps run eagerly.

        A background capture is stopped first; ``start_capture()`` or
        ``capture()`` brings the graphs back (the wake).
        """
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
        """Back the KV cache's reservation (``ManagerOptions.kv_cache``); no graph is captured again.

        Args:
            margin_bytes: grow it by the device's free memory beyond the
                margin, measured now (after the capture: torch's unused cache
                given back first), so that what stays free is the margin to
                within one chunk.
            units: back exactly that many units instead (at least; growing
                needs the memory free, shrinking the ids ``in_use``).
            in_use: with ``units``, the ids of the units in use: none may lie
                at or past ``units``.

        Returns:
            The units backed now (the ids the engine may hand out lie below it).

        Raises:
            ValueError: not exactly one of ``margin_bytes`` and ``units``, or
                what ``KVCacheMemory`` refuses; nothing changed.
            RuntimeError: built without a KV cache, or a background capture
                of this manager is running.
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

        Returns:
            The units backed now (``min_units``).

        Raises:
            RuntimeError: built without a KV cache, or a background capture
                of this manager is running.
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
        """Check every tensor the captured graphs read against the one they were captured with.

        A step checks a flag and the first parameter's address only; call this
        after a reload that swapped another tensor (docs/design.md,
        "Weights under graphs").

        Raises:
            WeightsReplacedError: naming every replaced tensor.
        """
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

        Args:
            uniform_decode: every request has the config's
                ``uniform_decode_query_len`` tokens (its uniform key, if any).
            num_active_loras: the adapters the step's requests use.
            invalid_modes: runtime modes this step may not replay.
            **inputs: one tensor per declared input, its rows the step's.

        Returns:
            The outputs cut to the real rows: views of graph memory, valid
            until the next ``run`` or ``run_loop`` (copy what you keep).

        Raises:
            ValueError: naming a bad input or argument, before a buffer is touched.
            NoGraphError: in strict mode, where the step has no captured graph.
            WeightsReplacedError: a tensor the graphs read was replaced.
            RuntimeError: another thread's call holds the static buffers, or
                the call came from inside one of this manager's.
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
        """``run`` with the inputs in one mapping (mypy rejects ``run(**batch)`` of a dict).

        Args:
            inputs: one tensor per declared input, by name.
            uniform_decode, num_active_loras, invalid_modes: as for ``run``.

        Returns:
            As ``run``.

        Raises:
            ValueError: ``inputs`` is no mapping; else as ``run``.
        """
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
        **inputs: torch.Tensor,
    ) -> LoopResult:
        """Up to ``max_steps`` decode steps of a uniform batch (``ManagerOptions.decode_loop``).

        On the device where the batch's decode loop is captured (one
        synchronization, to read the steps taken), else on the host over the
        same buffers (logged once per reason).

        Args:
            batch: the inputs in one mapping, or ``None`` to pass them as keywords.
            max_steps: at most this many steps (default: ``DecodeLoop.max_steps``).
            **inputs: one tensor per declared input, one token per request.

        Returns:
            The steps' tokens and count: ``LoopResult.tokens`` is valid until the
            next ``run_loop``, capture or ``estimate_memory()``.

        Raises:
            ValueError: naming a bad input or argument (``run_loop: ...``),
                before a buffer is touched.
            NoGraphError: in strict mode, where the loop would run on the host.
            WeightsReplacedError: a tensor the graphs read was replaced.
            RuntimeError: built without a decode loop; else as ``run``.
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
