"""A planned graph's two capture acts: the warm-up on pad values, and the recording.

The warm-up runs the model eagerly on the graph's static views filled with
pad values (never the last real batch: a warm-up really runs, KV-cache
writes included). The recording captures the graph without running anything
on the device (``GraphEngine.record``). Both hand the attention its metadata
(docs/design.md, "The attention seam"). ``capture()``, the background capture
and the estimate's probes all capture through these two.

A recording fails for one of two kinds of reasons, and one rule tells them
apart for every capture (``worth_retrying``). CUDA invalidated the stream
capture: an operation a capture refuses ran while it recorded (a
synchronization or a library handle's creation on the capturing thread, a
first use that a warm-up makes; a device-wide synchronization on another
thread); the engines raise ``CaptureInvalidatedError`` there, and the same
capture may succeed when tried again. Or the work failed while the capture
stayed valid (the model's own error, an out-of-memory, a refusal of
``set_capture_enabled(False)``): trying again fails again. The decision is
made on the exception types along the cause chain, never on their text.
Who retries: ``capture()`` a recording of a key it did not warm up, once,
after the key's warm-up (``_warm_up``); a capture thread each key up to
``RETRIES`` more times (``_thread``); a lockstep capture alike, on every
rank where every failed rank's error is worth it (``_lockstep``).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Final

import torch

from cudagraph_capture import (
    CaptureDisabledError,
    CaptureError,
    CaptureInvalidatedError,
    GraphEngine,
    GraphEntry,
)
from cudagraph_capture._enabled import check_capture_enabled
from cudagraph_capture.lowlevel import RecordSeconds
from cudagraph_dispatch import CUDAGraphMode, set_forward_context

from .._attention._seam import build_extra, metadata_extra
from .._memory._buffers import StaticBuffers
from .._memory._device import RecordingBytes
from .._memory._outputs import LayoutCell
from .._values._batch import StepBatch
from .._values._protocols import OutputT
from .._values._reports import CapturedGraph
from ._table import PlannedGraph


def warm_up(graph: PlannedGraph[OutputT], engine: GraphEngine[OutputT], buffers: StaticBuffers) -> None:
    """Fill the graph's views with pad values and run the model eagerly on them (current stream).

    Raises:
        CaptureError: naming the key, for the model's own error at this size.
    """
    try:
        buffers.fill_padding(graph.num_tokens, graph.num_reqs)
        builder = graph.builder
        if builder is None:
            engine.warm_up(graph.descriptor, graph.inputs)
            return
        # An all-padding batch's metadata, on the stream the warm-up is ordered after.
        extra = build_extra(builder, StepBatch.padding(), graph.shape)
        with set_forward_context(CUDAGraphMode.NONE, graph.descriptor, **extra):
            engine.warm_up(graph.descriptor, graph.inputs)
    except CaptureError:
        raise
    except Exception as error:
        raise CaptureError(
            f"the warm-up failed with {type(error).__name__}: {error}", graph.descriptor
        ) from error


def record(
    graph: PlannedGraph[OutputT],
    engine: GraphEngine[OutputT],
    device: torch.device,
    start: float,
    warmup_seconds: float,
) -> tuple[GraphEntry[OutputT], CapturedGraph]:
    """Record the graph (nothing runs on the device); the entry, not stored, and what it cost.

    The seconds count from ``start``, ``warmup_seconds`` of them the
    graph's warm-up; the bytes are the recording's alone (a warm-up's eager
    blocks are not the pool's). The caller checks the entry, then keeps it.
    """
    with RecordingBytes(device) as cost, _capture_metadata(graph):
        entry = engine.record(graph.descriptor, graph.inputs)
    spent = _checked_seconds(entry, graph)
    return entry, CapturedGraph(
        mode=graph.mode,
        descriptor=graph.descriptor,
        seconds=time.perf_counter() - start,
        pool_bytes=cost.pool,
        driver_bytes=cost.driver,
        warmup_seconds=warmup_seconds,
        recording_seconds=spent.recording,
        instantiation_seconds=spent.instantiation,
    )


def _checked_seconds(entry: object, graph: PlannedGraph[OutputT]) -> RecordSeconds:
    """``entry``'s ``seconds``, once ``entry`` is a ``GraphEntry`` (``replay``, ``output``, ``seconds``).

    An engine built by the caller's factory may return anything: ``ValueError``
    naming ``options.engine_factory`` (the key uncaptured), not an
    ``AttributeError`` here or a wrong report later.
    """
    spent = getattr(entry, "seconds", None)
    times = (getattr(spent, "recording", None), getattr(spent, "instantiation", None))
    lacks = []
    if not callable(getattr(entry, "replay", None)):
        lacks.append("replay()")
    if not hasattr(entry, "output"):
        lacks.append("output")
    if not all(_is_seconds(t) for t in times):
        lacks.append("seconds, a RecordSeconds(recording, instantiation) of finite seconds >= 0")
    if lacks:
        raise ValueError(
            f"options.engine_factory: the {graph.mode.name} engine's record() returned {entry!r:.80} for "
            f"{graph.descriptor}, expected a GraphEntry; it lacks {', '.join(lacks)}"
        )
    return RecordSeconds(*times)  # type: ignore[arg-type]  # checked above: two numbers


def _is_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def capture_graph(
    graph: PlannedGraph[OutputT],
    engine: GraphEngine[OutputT],
    buffers: StaticBuffers,
    layout: LayoutCell,
    *,
    warm: bool,
    warmed_seconds: float = 0.0,
) -> CapturedGraph:
    """Warm ``graph`` up (``warm``), record it, check its outputs, keep the entry: it is captured.

    ``warmed_seconds``: a warm-up of it run earlier (the background
    capture's), counted in its seconds.

    Raises:
        CaptureError: from the engine; ValueError: an output that cannot be
            cut. Either leaves the graph uncaptured.
    """
    start = time.perf_counter() - warmed_seconds
    check_capture_enabled(graph.descriptor)  # before the warm-up: a disabled capture runs nothing
    if warm:
        warm_up(graph, engine, buffers)
    warmup = time.perf_counter() - start if warm else warmed_seconds
    entry, captured = record(graph, engine, buffers.device, start, warmup)
    layout.of(entry.output).check(entry.output, graph.num_tokens, graph.num_reqs)
    graph.keep(entry)  # last: the serving thread replays it from its next step
    return captured


def _capture_metadata(graph: PlannedGraph[OutputT]) -> contextlib.AbstractContextManager[object]:
    """The forward context that hands the recording its metadata (``build_for_capture``: host only)."""
    builder = graph.builder
    if builder is None:
        return contextlib.nullcontext()
    try:
        metadata = builder.build_for_capture(graph.shape)
    except Exception as error:
        raise CaptureError(
            f"the attention's build_for_capture({graph.shape}) failed with {type(error).__name__}: {error}",
            graph.descriptor,
        ) from error
    extra = metadata_extra(builder, metadata, call="build_for_capture")
    graph.recorded_with(metadata)
    return set_forward_context(CUDAGraphMode.NONE, graph.descriptor, **extra)


#: More tries of a key whose background (or lockstep) capture CUDA invalidated.
RETRIES: Final = 2
#: Errors that no retry mends, wherever they sit in a cause chain.
_NEVER: Final = (CaptureDisabledError, torch.OutOfMemoryError)


def worth_retrying(error: BaseException) -> bool:
    """Whether the capture that raised ``error`` may succeed when tried again: CUDA invalidated it.

    True where a ``CaptureInvalidatedError`` is in the chain (``error``, then
    each ``__cause__``, else ``__context__``; a link seen twice ends the walk)
    and neither a capture refusal (``CaptureDisabledError``) nor an
    out-of-memory (``torch.OutOfMemoryError``) is.
    """
    invalidated = False
    seen: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and not any(link is other for other in seen):  # a chain set by hand may loop
        if isinstance(link, _NEVER):
            return False
        invalidated = invalidated or isinstance(link, CaptureInvalidatedError)
        seen.append(link)
        link = link.__cause__ or link.__context__
    return invalidated
