"""Model-level CUDA graphs: dispatch, capture and replay over static buffers.

``CUDAGraphManager`` owns one static buffer per model input and one graph per
key of the dispatcher's capture plan. Everything a step needs is built once:
each graph's views of the buffers (its keyword arguments), its forward
context; slices for partial batches are cut once per row count and cached.
A step then validates, dispatches, copies, replays and cuts the outputs
without re-deriving any of it. This module orchestrates; the buffers, the
input check and the copy live in ``_buffers``, the capture loop's
surroundings in ``_capture_phase``, the default engines in ``_engines``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, Generic, cast

import torch

from cudagraph_capture import CaptureOptions, GraphEngine
from cudagraph_dispatch import (
    FORWARD_CONTEXT_VAR,
    BatchDescriptor,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    Dispatch,
    DispatchConfig,
    ForwardContext,
    set_forward_context,
)

from ._buffers import REQS, TOKENS, WHOLE, Input, InputChecker, Slot, allocate, check_inputs_spec, load
from ._capture_phase import capture_phase, reserved_bytes, synchronize
from ._engines import capture_engine
from ._errors import NoGraphError
from ._outputs import OutputLayout, OutputRows, check_output_rows, uses_reqs
from ._progress import progress as progress_bar
from ._protocols import GraphEngineFactory, OutputT
from ._report import CapturedGraph, CaptureReport, ManagerStats
from ._static import StaticInput

_logger: Final = logging.getLogger("cudagraph_manager")
_NONE: Final = CUDAGraphMode.NONE
_NO_MODES: Final[frozenset[CUDAGraphMode]] = frozenset()


class _Graph:
    """One key of the capture plan: what its graph reads, its context, engine and counters."""

    __slots__ = (
        "context",
        "descriptor",
        "engine",
        "memo",
        "mode",
        "num_reqs",
        "num_tokens",
        "replays",
        "slots",
        "views",
    )

    def __init__(
        self, mode: CUDAGraphMode, descriptor: BatchDescriptor, inputs: tuple[Input, ...], max_num_seqs: int
    ) -> None:
        self.mode = mode
        self.descriptor = descriptor
        self.context = ForwardContext(mode, descriptor)
        self.num_tokens = descriptor.num_tokens
        # PIECEWISE keys are relaxed (no request count): size their request rows like vLLM does.
        self.num_reqs = (
            descriptor.num_reqs if descriptor.num_reqs is not None else min(self.num_tokens, max_num_seqs)
        )
        rows = {TOKENS: self.num_tokens, REQS: self.num_reqs, WHOLE: -1}
        self.slots = tuple(Slot(source, rows[source.kind]) for source in inputs)
        self.views = {slot.name: slot.view for slot in self.slots}  # the graph's keyword arguments
        self.engine: GraphEngine[..., object] | None = None  # set once this key is captured
        self.replays = 0
        # The last (engine output, num_tokens, num_reqs, cut output): steps of one size reuse it.
        self.memo: tuple[object, int, int, object] | None = None


class CUDAGraphManager(Generic[OutputT]):
    """Captures a model's forward as CUDA graphs and replays them, one call per step.

    ``model`` is any callable (an ``nn.Module``, a bound method, a compiled
    function) taking the ``inputs`` as keyword arguments and returning a tensor
    or a flat tuple, list or dict of tensors. Each input gets a static buffer
    on ``device`` (default: the current CUDA device), allocated once and
    filled with its ``pad_value``. ``config`` decides which graphs exist
    (through a ``CUDAGraphDispatcher``); ``options`` go to the capture engines
    (one pool: ``options.pool``, else the capture package's shared
    pool of the device). ``output_rows`` says which count each output's leading
    dimension follows ("tokens" by default), so ``run`` can cut it back to the
    real batch. ``strict=True`` raises ``NoGraphError`` where a batch would
    run eagerly. ``engine_factory`` replaces the capture engines (a seam for
    tests and other engines).

    Not thread-safe: one manager's buffers serve one step at a time.
    """

    def __init__(
        self,
        model: Callable[..., OutputT],
        inputs: Mapping[str, StaticInput],
        config: DispatchConfig,
        *,
        device: torch.device | str | int | None = None,
        strict: bool = False,
        options: CaptureOptions | None = None,
        output_rows: OutputRows = "tokens",
        engine_factory: GraphEngineFactory | None = None,
    ) -> None:
        if not callable(model):
            raise ValueError(f"model: expected a callable, got {type(model).__name__}")
        self._dispatcher: Final = CUDAGraphDispatcher(config)  # validates config
        checked = check_inputs_spec(inputs)
        if not isinstance(strict, bool):
            raise ValueError(f"strict: expected a bool, got {strict!r}")
        given_options: object = options
        if given_options is not None and not isinstance(given_options, CaptureOptions):
            raise ValueError(f"options: expected CaptureOptions or None, got {options!r}")
        self._output_rows: Final = check_output_rows(output_rows)
        if uses_reqs(self._output_rows) and not any(s.rows == "reqs" for s in checked.values()):
            raise ValueError(
                "output_rows: an output follows 'reqs', but no input has rows='reqs' to count them"
            )
        self._device: Final = _resolve_device(device)
        if engine_factory is None and self._device.type != "cuda":
            raise ValueError(f"device: the CUDA graph engines need a CUDA device, got {self._device}")

        self._model: Final = model
        self._strict: Final = strict
        self._options: Final = options if options is not None else CaptureOptions()
        self._engine_factory: Final[GraphEngineFactory] = (
            engine_factory if engine_factory is not None else capture_engine
        )
        self._engines: dict[CUDAGraphMode, GraphEngine[..., object]] = {}
        self._layout: OutputLayout | None = None  # from the first warm-up

        self._inputs: Final = allocate(checked, config.capture_sizes.max, config.max_num_seqs, self._device)
        # Bound once: run() checks its inputs with one call per step.
        self._check_inputs: Final = InputChecker.of(
            self._inputs, self._device, config.max_num_seqs, config.uniform_decode_query_len
        ).check
        self._graphs: Final[dict[BatchDescriptor, _Graph]] = {
            descriptor: _Graph(mode, descriptor, self._inputs, config.max_num_seqs)
            for mode, descriptors in self._dispatcher.capture_plan()
            for descriptor in descriptors
        }
        self._max_tokens: Final = config.capture_sizes.max
        self._logged_fallbacks: set[tuple[BatchDescriptor | None, bool, bool]] = set()
        self._eager_runs = 0
        self._uncaptured_runs = 0
        self._padded_tokens = 0

    # -- accessors --

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dispatcher(self) -> CUDAGraphDispatcher:
        """The dispatcher built from ``config``: the graphs that exist are its keys."""
        return self._dispatcher

    @property
    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        """The static input buffers by name (read-only mapping; the tensors are the live buffers)."""
        return MappingProxyType({s.name: s.buffer for s in self._inputs})

    @property
    def num_captured(self) -> int:
        """How many keys of the capture plan have a captured graph."""
        return sum(g.engine is not None for g in self._graphs.values())

    @property
    def stats(self) -> ManagerStats:
        """A snapshot of what ``run`` did since construction or ``reset_stats``."""
        replays: dict[tuple[CUDAGraphMode, int], int] = {}
        for graph in self._graphs.values():
            if graph.replays:
                key = (graph.mode, graph.num_tokens)
                replays[key] = replays.get(key, 0) + graph.replays
        return ManagerStats(
            replays=MappingProxyType(replays),
            eager_runs=self._eager_runs,
            uncaptured_runs=self._uncaptured_runs,
            padded_tokens=self._padded_tokens,
        )

    def clear(self) -> None:
        """Free every captured graph (the pool stays usable); ``capture()`` captures them anew."""
        for engine in self._engines.values():
            engine.clear()
        for graph in self._graphs.values():
            graph.engine = None
            graph.memo = None

    def reset_stats(self) -> None:
        for graph in self._graphs.values():
            graph.replays = 0
        self._eager_runs = self._uncaptured_runs = self._padded_tokens = 0

    # -- capture --

    def capture(self, *, progress: bool | None = None) -> CaptureReport:
        """Capture every key of the capture plan not captured yet; report what it cost.

        Order: the PIECEWISE group, then FULL, each largest first, all into one
        shared pool (smaller graphs reuse the memory of larger ones). Each key's
        views are filled with the inputs' pad values, then the engine warms the
        shape up on its capture stream (``options.warmup_runs``, default 1: it
        allocates what the model caches lazily and compiles what
        ``torch.compile`` compiles) and captures it; its outputs are checked
        against ``output_rows``. The garbage collector is paused for the phase
        (restored after, also on error). ``progress``: show a tqdm bar
        (default: when stderr is a terminal). A capture error (``CaptureError``,
        naming the key) propagates; the keys captured before it stay usable,
        and ``capture()`` can be called again for the rest.
        """
        pending = [g for g in self._graphs.values() if g.engine is None]
        device = self._device
        records: list[CapturedGraph] = []
        with capture_phase(device):
            reserved_before = reserved_bytes(device)
            start = time.perf_counter()
            for graph in progress_bar(pending, desc="Capturing CUDA graphs", enabled=progress):
                records.append(self._capture_graph(graph))
            synchronize(device)  # once, so the total includes the device's work
            seconds = time.perf_counter() - start
            reserved = reserved_bytes(device) - reserved_before
        return CaptureReport(graphs=tuple(records), seconds=seconds, reserved_bytes=reserved)

    def _capture_graph(self, graph: _Graph) -> CapturedGraph:
        start = time.perf_counter()
        # The warm-up and a breakable capture really run the model (its eager
        # breaks included) on the buffers: pad values, never the last real batch.
        for slot in graph.slots:
            if slot.kind != WHOLE:
                slot.view.fill_(slot.pad_value)
        engine = self._engine(graph.mode)
        before = reserved_bytes(self._device)
        # The engine warms this shape up on its capture stream (options.warmup_runs), then captures.
        with set_forward_context(graph.mode, graph.descriptor):
            output = engine(**graph.views)
        pool_bytes = reserved_bytes(self._device) - before
        if self._layout is None:
            self._layout = OutputLayout.of(output, self._output_rows)
        self._layout.check(output, graph.num_tokens, graph.num_reqs)
        del output  # the engine keeps a non-owning alias: smaller graphs may reuse this memory
        graph.engine = engine
        graph.memo = None
        return CapturedGraph(graph.mode, graph.descriptor, time.perf_counter() - start, pool_bytes)

    def _engine(self, mode: CUDAGraphMode) -> GraphEngine[..., object]:
        """The one engine per runtime mode, built on first use with the shared pool."""
        engine = self._engines.get(mode)
        if engine is None:
            # options.pool None: the engines look the shared pool up at each capture,
            # so they follow it when a failed capture replaces it.
            engine = self._engines[mode] = self._engine_factory(self._model, mode, self._options)
        return engine

    # -- run --

    def run(
        self,
        /,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = _NO_MODES,
        **inputs: torch.Tensor,
    ) -> OutputT:
        """Run one batch: replay its graph on the padded batch, or run the model eagerly.

        The inputs are checked first (exact names, tensors of the declared
        dtype, on ``device``, with the declared trailing shape, and consistent
        row counts): any mismatch raises ``ValueError`` naming the input, before
        a buffer is touched. The token rows decide the dispatch. With a graph,
        the inputs are copied into the static buffers, padding rows are filled
        with ``pad_value``, the graph is replayed, and the outputs come back cut
        to the real rows (views of graph memory: they stay valid until the next
        ``run`` of this manager, or any replay from the same pool; copy what
        must live longer). Without one (above the largest size, a kind of batch
        the mode has no graph for, not captured yet) the model runs eagerly on
        the given tensors and the run is counted in ``stats``; a ``strict``
        manager raises ``NoGraphError`` instead. Runs without autograd.
        ``run_batch`` is the same call with the inputs in one mapping.
        """
        return self._run(inputs, uniform_decode, num_active_loras, invalid_modes)

    def run_batch(
        self,
        inputs: Mapping[str, torch.Tensor],
        /,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = _NO_MODES,
    ) -> OutputT:
        """``run`` with the inputs in one mapping: the same checks, dispatch and outputs.

        For typed callers holding a ``dict[str, Tensor]``: mypy rejects
        ``run(**batch)`` because such a dict could hold ``run``'s own keywords.
        """
        given: object = inputs
        if given.__class__ is not dict and not isinstance(given, Mapping):
            raise ValueError(
                f"inputs: expected a mapping of input names to tensors, got {type(given).__name__}"
            )
        return self._run(inputs, uniform_decode, num_active_loras, invalid_modes)

    def _run(
        self,
        inputs: Mapping[str, torch.Tensor],
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> OutputT:
        """The step: check, dispatch, then replay (copy, pad, replay, cut) or run eagerly."""
        num_tokens, num_reqs, grad = self._check_inputs(inputs, uniform_decode)
        dispatch = self._dispatcher.dispatch(
            num_tokens,
            uniform_decode=uniform_decode,
            num_active_loras=num_active_loras,
            invalid_modes=invalid_modes,
        )
        graph = self._graphs[dispatch.descriptor] if dispatch.mode is not _NONE else None
        engine = graph.engine if graph is not None else None
        if graph is None or engine is None:
            return self._run_eager(
                inputs, num_tokens, dispatch, uniform_decode, num_active_loras, invalid_modes
            )
        if grad and torch.is_grad_enabled():
            with torch.no_grad():  # a copy from a tensor that requires grad would record history
                load(graph.slots, inputs, num_tokens, num_reqs)
        else:
            load(graph.slots, inputs, num_tokens, num_reqs)

        token = FORWARD_CONTEXT_VAR.set(graph.context)
        try:
            raw = engine(**graph.views)
        finally:
            FORWARD_CONTEXT_VAR.reset(token)
        graph.replays += 1
        self._padded_tokens += graph.num_tokens - num_tokens

        memo = graph.memo
        if memo is not None and memo[0] is raw and memo[1] == num_tokens and memo[2] == num_reqs:
            cached = memo[3]
            # A fresh list or dict each step: a caller's edits must not reach the next step.
            return cast(OutputT, cached.copy() if isinstance(cached, (list, dict)) else cached)
        layout = self._layout
        assert layout is not None  # set by the warm-up of every captured key
        out = layout.cut(raw, num_tokens, num_reqs)
        graph.memo = (raw, num_tokens, num_reqs, out)
        return cast(OutputT, out.copy() if isinstance(out, (list, dict)) else out)

    def _run_eager(
        self,
        inputs: Mapping[str, torch.Tensor],
        num_tokens: int,
        dispatch: Dispatch,
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> OutputT:
        """The model on the caller's tensors, unpadded; counted (strict: ``NoGraphError``)."""
        uncaptured = dispatch.mode is not _NONE
        if self._strict:
            reason = self._why_eager(num_tokens, dispatch, uniform_decode, num_active_loras, invalid_modes)
            raise NoGraphError(num_tokens, reason)
        # Counted always; logged once per kind of fallback, so a log shows it without flooding.
        kind = (dispatch.descriptor if uncaptured else None, num_tokens > self._max_tokens, uniform_decode)
        if kind not in self._logged_fallbacks:
            self._logged_fallbacks.add(kind)
            reason = self._why_eager(num_tokens, dispatch, uniform_decode, num_active_loras, invalid_modes)
            _logger.warning("running a batch of %d tokens eagerly: %s", num_tokens, reason)
        with set_forward_context(_NONE, BatchDescriptor(num_tokens)), torch.no_grad():
            out = self._model(**inputs)
        self._eager_runs += 1
        if uncaptured:
            self._uncaptured_runs += 1
        return out

    def _why_eager(
        self,
        num_tokens: int,
        dispatch: Dispatch,
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> str:
        if dispatch.mode is not _NONE:
            mode = dispatch.mode.name
            return f"its {mode} graph {dispatch.descriptor} was not captured yet; call capture() first"
        return self._dispatcher.explain(
            num_tokens,
            uniform_decode=uniform_decode,
            num_active_loras=num_active_loras,
            invalid_modes=invalid_modes,
        )


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a torch.device with an index for CUDA (tensors report one, comparisons need it)."""
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("device: no CUDA device is available; pass device= explicitly")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device: expected a torch.device, a device string or a CUDA index, got {device!r}"
        ) from exc
    index: int | None = resolved.index  # None for "cuda" (torch's stubs say int)
    if resolved.type == "cuda" and index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved
