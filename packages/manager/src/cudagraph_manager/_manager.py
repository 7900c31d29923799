"""Model-level CUDA graphs: static buffers, padding, dispatch, capture and replay.

``CUDAGraphManager`` owns one static buffer per model input and one graph per
key of the dispatcher's capture plan. Everything a step needs is built once:
each graph's views of the buffers (its keyword arguments), its forward
context; slices for partial batches are cut once per row count and cached.
A step then validates, dispatches, copies, replays and cuts the outputs
without re-deriving any of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Final, Generic, cast

import torch

from cudagraph_capture import (
    BreakableCUDAGraphWrapper,
    CaptureOptions,
    CUDAGraphWrapper,
    GraphEngine,
)
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

from ._errors import NoGraphError
from ._outputs import OutputLayout, OutputRows, check_output_rows, uses_reqs
from ._progress import progress as progress_bar
from ._protocols import GraphEngineFactory, OutputT
from ._report import CapturedGraph, CaptureReport, ManagerStats
from ._static import StaticInput

_logger: Final = logging.getLogger("cudagraph_manager")
_NONE: Final = CUDAGraphMode.NONE
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
_FULL: Final = CUDAGraphMode.FULL
_NO_MODES: Final[frozenset[CUDAGraphMode]] = frozenset()
_Tensor: Final = torch.Tensor

#: Keyword arguments of ``run`` itself: no model input may be named so.
RESERVED_NAMES: Final = frozenset({"uniform_decode", "num_active_loras", "invalid_modes"})

# Row kinds of an input, as small ints for the per-step loops.
_TOKENS: Final = 0
_REQS: Final = 1
_WHOLE: Final = 2
_KINDS: Final = {"tokens": _TOKENS, "reqs": _REQS, None: _WHOLE}


def capture_engine(
    model: Callable[..., object], mode: CUDAGraphMode, options: CaptureOptions
) -> GraphEngine[..., object]:
    """The default engines: FULL -> ``CUDAGraphWrapper``, PIECEWISE -> ``BreakableCUDAGraphWrapper``."""
    if mode is _FULL:
        return CUDAGraphWrapper(model, _FULL, options)
    if mode is _PIECEWISE:
        return BreakableCUDAGraphWrapper(model, options)
    raise ValueError(f"mode: expected FULL or PIECEWISE, got {mode!r}")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Input:
    """One declared input and the static buffer that holds it."""

    name: str
    spec: StaticInput
    kind: int  # _TOKENS, _REQS or _WHOLE
    buffer: torch.Tensor  # [max rows, *spec.shape], or spec.shape for _WHOLE


class _Slot:
    """One input as one graph sees it: a view of the buffer, and how to fill it."""

    __slots__ = ("_splits", "kind", "name", "pad_value", "rows", "view")

    def __init__(self, source: _Input, rows: int) -> None:
        self.name = source.name
        self.kind = source.kind
        self.pad_value = source.spec.pad_value
        self.rows = rows  # the graph's row count for this input; -1 for _WHOLE
        self.view = source.buffer if source.kind == _WHOLE else source.buffer[:rows]  # [rows, *shape]
        self._splits: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def split(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(view[:n], view[n:])``: the real rows and the padding.

        Cached per row count (slicing costs microseconds; at most ``rows`` entries).
        """
        pair = self._splits.get(n)
        if pair is None:
            pair = self._splits[n] = (self.view[:n], self.view[n:])
        return pair


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
        self, mode: CUDAGraphMode, descriptor: BatchDescriptor, inputs: tuple[_Input, ...], max_num_seqs: int
    ) -> None:
        self.mode = mode
        self.descriptor = descriptor
        self.context = ForwardContext(mode, descriptor)
        self.num_tokens = descriptor.num_tokens
        # PIECEWISE keys are relaxed (no request count): size their request rows like vLLM does.
        self.num_reqs = (
            descriptor.num_reqs if descriptor.num_reqs is not None else min(self.num_tokens, max_num_seqs)
        )
        rows = {_TOKENS: self.num_tokens, _REQS: self.num_reqs, _WHOLE: -1}
        self.slots = tuple(_Slot(source, rows[source.kind]) for source in inputs)
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
        checked = _check_inputs_spec(inputs)
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

        max_rows = {_TOKENS: config.capture_sizes.max, _REQS: config.max_num_seqs}
        sources: list[_Input] = []
        for name, spec in checked.items():
            kind = _KINDS[spec.rows]
            shape = spec.shape if kind == _WHOLE else (max_rows[kind], *spec.shape)
            buffer = torch.full(shape, spec.pad_value, dtype=spec.dtype, device=self._device)
            sources.append(_Input(name, spec, kind, buffer))
        self._inputs: Final = tuple(sources)
        # Per input, what run() checks: (name, dtype, ndim, trailing shape or whole shape, kind).
        self._checks: Final = tuple(
            (s.name, s.spec.dtype, len(s.spec.shape) + (s.kind != _WHOLE), s.spec.shape, s.kind)
            for s in sources
        )
        self._graphs: Final[dict[BatchDescriptor, _Graph]] = {
            descriptor: _Graph(mode, descriptor, self._inputs, config.max_num_seqs)
            for mode, descriptors in self._dispatcher.capture_plan()
            for descriptor in descriptors
        }
        self._max_num_seqs: Final = config.max_num_seqs
        self._query_len: Final = config.uniform_decode_query_len
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
        with _capture_phase(device):
            reserved_before = _reserved_bytes(device)
            start = time.perf_counter()
            for graph in progress_bar(pending, desc="Capturing CUDA graphs", enabled=progress):
                records.append(self._capture_graph(graph))
            _synchronize(device)  # once, so the total includes the device's work
            seconds = time.perf_counter() - start
            reserved = _reserved_bytes(device) - reserved_before
        return CaptureReport(graphs=tuple(records), seconds=seconds, reserved_bytes=reserved)

    def _capture_graph(self, graph: _Graph) -> CapturedGraph:
        start = time.perf_counter()
        # The warm-up and a breakable capture really run the model (its eager
        # breaks included) on the buffers: pad values, never the last real batch.
        for slot in graph.slots:
            if slot.kind != _WHOLE:
                slot.view.fill_(slot.pad_value)
        engine = self._engine(graph.mode)
        before = _reserved_bytes(self._device)
        # The engine warms this shape up on its capture stream (options.warmup_runs), then captures.
        with set_forward_context(graph.mode, graph.descriptor):
            output = engine(**graph.views)
        pool_bytes = _reserved_bytes(self._device) - before
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
                _load(graph.slots, inputs, num_tokens, num_reqs)
        else:
            _load(graph.slots, inputs, num_tokens, num_reqs)

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

    def _check_inputs(
        self, inputs: Mapping[str, torch.Tensor], uniform_decode: bool
    ) -> tuple[int, int, bool]:
        """``(num_tokens, num_reqs, any input requires grad)``; ``num_reqs`` is -1 without "reqs" inputs.

        Cheap by design (this is per step): dtype and device are compared as
        objects, shapes as tuples.
        """
        if len(inputs) != len(self._checks):
            raise self._names_error(inputs)
        device = self._device
        num_tokens = num_reqs = -1
        tokens_from = reqs_from = ""
        grad = False
        for name, dtype, ndim, shape, kind in self._checks:
            x = inputs.get(name)
            if x.__class__ is not _Tensor and not isinstance(x, _Tensor):
                if name not in inputs:
                    raise self._names_error(inputs)
                raise ValueError(f"run: input {name!r}: expected a torch.Tensor, got {type(x).__name__}")
            assert x is not None
            if x.dtype is not dtype:
                raise ValueError(f"run: input {name!r}: expected dtype {dtype}, got {x.dtype}")
            if x.device != device:
                raise ValueError(f"run: input {name!r}: expected a tensor on {device}, got one on {x.device}")
            size = x.shape
            if kind == _WHOLE:
                if size != shape:
                    raise ValueError(
                        f"run: input {name!r}: expected shape {shape} (not batched), got {tuple(size)}"
                    )
            else:
                if len(size) != ndim or size[1:] != shape:
                    raise ValueError(
                        f"run: input {name!r}: expected shape [rows, *{shape}], got {tuple(size)}"
                    )
                rows = size[0]
                if kind == _TOKENS:
                    if num_tokens < 0:
                        num_tokens, tokens_from = rows, name
                    elif rows != num_tokens:
                        raise ValueError(
                            f"run: input {name!r}: {rows} rows, but input {tokens_from!r} has {num_tokens}; "
                            "all 'tokens' inputs have num_tokens rows"
                        )
                elif num_reqs < 0:
                    num_reqs, reqs_from = rows, name
                elif rows != num_reqs:
                    raise ValueError(
                        f"run: input {name!r}: {rows} rows, but input {reqs_from!r} has {num_reqs}; "
                        "all 'reqs' inputs have num_reqs rows"
                    )
            if x.requires_grad:
                grad = True
        if num_reqs >= 0:
            if num_reqs > self._max_num_seqs:
                raise ValueError(
                    f"run: input {reqs_from!r}: {num_reqs} rows (num_reqs) exceed "
                    f"max_num_seqs={self._max_num_seqs}"
                )
            if num_reqs > num_tokens:
                raise ValueError(
                    f"run: input {reqs_from!r}: {num_reqs} requests for {num_tokens} tokens; "
                    "every request has at least one token"
                )
            if uniform_decode and num_tokens != num_reqs * self._query_len:
                raise ValueError(
                    f"uniform_decode: a uniform decode batch has num_reqs * {self._query_len} tokens, "
                    f"got {num_tokens} tokens for {num_reqs} requests"
                )
        return num_tokens, num_reqs, grad

    def _names_error(self, inputs: Mapping[str, object]) -> ValueError:
        expected = [name for name, *_ in self._checks]
        missing = [n for n in expected if n not in inputs]
        unknown = sorted(n for n in inputs if n not in expected)
        parts = [f"missing input(s) {missing}"] if missing else []
        parts += [f"unknown input(s) {unknown}"] if unknown else []
        return ValueError(f"run: {'; '.join(parts)}; expected exactly {expected}")

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


def _load(
    slots: tuple[_Slot, ...], inputs: Mapping[str, torch.Tensor], num_tokens: int, num_reqs: int
) -> None:
    """Copy the batch into one graph's views of the static buffers; pad the rest.

    Real rows first, then the padding rows, so an input that already is (a
    prefix of) its static buffer is not overwritten before it is read.
    """
    for slot in slots:
        src = inputs[slot.name]  # [n, *shape], or shape for _WHOLE
        kind = slot.kind
        if kind == _WHOLE:
            slot.view.copy_(src)
            continue
        n = num_tokens if kind == _TOKENS else num_reqs
        if n == slot.rows:
            slot.view.copy_(src)
        else:
            head, tail = slot.split(n)
            head.copy_(src)
            tail.fill_(slot.pad_value)


def _check_inputs_spec(inputs: Mapping[str, StaticInput]) -> dict[str, StaticInput]:
    """The declared inputs, validated: names usable as keywords, at least one "tokens" input."""
    given: object = inputs
    if not isinstance(given, Mapping) or not given:
        raise ValueError(f"inputs: expected a non-empty mapping of names to StaticInput, got {inputs!r}")
    checked: dict[str, StaticInput] = {}
    for name, spec in inputs.items():
        given_name: object = name  # checked at run time: callers may not be typed
        if not isinstance(given_name, str) or not given_name.isidentifier():
            raise ValueError(f"inputs: names are passed as keywords, so must be identifiers, got {name!r}")
        if name in RESERVED_NAMES:
            raise ValueError(f"inputs[{name!r}]: the name is a keyword of run() itself; rename the input")
        if not isinstance(spec, StaticInput):
            raise ValueError(f"inputs[{name!r}]: expected a StaticInput, got {spec!r}")
        checked[name] = spec
    if not any(spec.rows == "tokens" for spec in checked.values()):
        raise ValueError(
            "inputs: at least one input needs rows='tokens': its row count is the batch's num_tokens"
        )
    return checked


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


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the garbage collector: no collection walks the heap between captures.

    Existing objects are frozen (explicit ``gc.collect`` calls then skip
    them) unless the application froze some itself: unfreezing would thaw those.
    """
    was_enabled = gc.isenabled()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _capture_phase(device: torch.device) -> Iterator[None]:
    """The capture loop's surroundings: gc paused, no autograd, ``device`` current."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_gc_paused())
        stack.enter_context(torch.no_grad())
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield


def _reserved_bytes(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
