"""The decode loops' capture: a ``DeviceLoop`` per captured loopable graph, then one shrinking loop per class.

``capture()`` captures, after the keys, a loop (the model's forward, then the
``advance``) for every captured FULL graph with a request row per token, into
the same pool and on shared device cells; then, for each class of keys
(uniform, LoRA fields alike), ``DeviceLoop.shrinking`` combines their bodies
into one loop that keeps its live requests in front and runs the smallest
key holding them (docs/design.md, "Decode loops"). Where a class cannot
shrink (one key, a builder that cannot move its rows, no WHILE or no choice
on this device) its keys keep their own loops, the reason logged once. A
loop that fails to capture is logged: its ``run_loop`` loops on the host
meanwhile; where a loop must run on the device (its kind forced, or a strict
manager), the failure raises.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Generic

import torch

from cudagraph_capture import CaptureError, CaptureOptions, DeviceLoop, LoopKind
from cudagraph_capture.lowlevel import LoopRows
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, ForwardContext
from cudagraph_dispatch._context import FORWARD_CONTEXT_VAR

from .._attention._seam import build_extra
from .._memory._buffers import LoopBuffers
from .._memory._device import RecordingBytes
from .._parts import ManagerParts
from .._values._batch import StepBatch
from .._values._loop import FINISHED, LoopState, ShrinkFallback
from .._values._protocols import OutputT
from .._values._reports import CapturedGraph
from ._table import GraphTable, PlannedGraph

_logger: Final = logging.getLogger("cudagraph_manager")
#: A class of loopable keys: what their descriptors share (uniform, has_lora, num_active_loras).
_Class = tuple[bool, bool, int]


class LoopCapture(Generic[OutputT]):
    """Records a manager's decode loops into its graph table, or (the estimate's probes) into a pool."""

    __slots__ = ("_buffers", "_logged", "_parts", "_table")

    def __init__(
        self, parts: ManagerParts[OutputT], buffers: LoopBuffers[OutputT], table: GraphTable[OutputT]
    ) -> None:
        self._parts: Final = parts
        self._buffers: Final = buffers
        self._table: Final = table
        self._logged: Final[set[ShrinkFallback]] = set()  # the shrink fallbacks logged once each

    def missing(self, *, captured_only: bool) -> list[PlannedGraph[OutputT]]:
        """The loopable graphs without a loop (``captured_only``: those whose one-step graph is captured)."""
        loops = self._table.loops
        return [
            graph
            for graph in self._table.graphs.values()
            if graph.loopable
            and graph.descriptor not in loops
            and (graph.entry is not None or not captured_only)
        ]

    def capture_missing(self, options: CaptureOptions) -> tuple[list[CapturedGraph], str | None]:
        """Capture the loop of every captured loopable graph that has none, then shrink each class.

        A loop's failure is logged, unless the loop must run on the device (a
        forced ``LoopKind``, or a strict manager): then it raises, as a key's
        capture does. Returns the loops' rows of the report, and why the
        loops do not shrink (``ShrinkFallback``'s value and the detail; ``None``
        where they do, where no loop was captured, or where
        ``DecodeLoop.shrink`` did not ask for it).
        """
        captured = []
        must = self._parts.strict or self._buffers.config.policy.kind is not None
        for graph in self.missing(captured_only=True):
            shared = next(iter(self._table.loops.values()), None)  # every loop of the table shares cells
            try:
                loop, record = self.record(graph, options, shared_with=shared)
            except CaptureError as error:
                if must:
                    raise
                _logger.warning(
                    "decode loop of %s not captured, its run_loop loops on the host: %s",
                    graph.descriptor,
                    error,
                )
                continue
            self._table.keep_loop(graph.descriptor, loop)
            captured.append(record)
        return captured, (self._shrink() if captured and self._buffers.config.shrink else None)

    def record(
        self, graph: PlannedGraph[OutputT], options: CaptureOptions, shared_with: DeviceLoop | None = None
    ) -> tuple[DeviceLoop, CapturedGraph]:
        """``graph``'s loop recorded into ``options``' pool, not kept, and what it cost."""
        start = time.perf_counter()
        parts, buffers = self._parts, self._buffers
        parts.buffers.fill_padding(graph.num_tokens, graph.num_reqs)
        extra = build_extra(parts.builder, StepBatch.padding(), graph.shape)  # valid values for the warm-up
        buffers.reset(0)  # the warm-up's rows are all padding
        context = ForwardContext(CUDAGraphMode.FULL, graph.descriptor, extra)

        def body(step: torch.Tensor) -> None:  # a context per call: an attention may key its plan on it
            iteration(parts, graph.inputs, ForwardContext(*context), buffers.state(step, graph.num_reqs))

        config = buffers.config
        with torch.no_grad(), RecordingBytes(parts.device) as cost:
            loop = DeviceLoop.capture(
                body,
                stop=buffers.stop,
                max_steps=config.max_steps,
                policy=config.policy,
                options=options,
                descriptor=graph.descriptor,
                shared_with=shared_with,
            )
        seconds = time.perf_counter() - start
        captured = CapturedGraph(
            mode=CUDAGraphMode.FULL,
            descriptor=graph.descriptor,
            seconds=seconds,
            pool_bytes=cost.pool,
            driver_bytes=cost.driver,
            loop=True,
        )
        return loop, captured

    # -- shrinking --

    def _shrink(self) -> str | None:
        """Each class's loops combined into one shrinking loop, kept for its keys; why a class does not."""
        why: str | None = None
        for keys in _classes(self._table.loops):
            loops = list({id(loop): loop for loop in (self._table.loops[k] for k in keys)}.values())
            if len(loops) == 1 and loops[0].sizes:
                continue  # shrinking already, over every key of the class
            try:
                loop = self._shrinking(keys, loops)
            except _NoShrinkError as reason:
                self._note(reason.fallback, reason.detail)
                why = why or f"{reason.fallback.value}: {reason.detail}"
                continue
            for key in keys:
                self._table.keep_loop(key, loop)
        return why

    def _shrinking(self, keys: Sequence[BatchDescriptor], loops: Sequence[DeviceLoop]) -> DeviceLoop:
        """The shrinking loop of one class's ``loops``; ``_NoShrinkError`` saying why there is none."""
        if len(keys) < 2:
            raise _NoShrinkError(
                ShrinkFallback.ONE_GRAPH,
                f"{keys[0]} is the only loopable key of its class: no smaller graph to choose",
            )
        names, rows = self._request_rows()
        not_while = next((loop for loop in loops if loop.kind is not LoopKind.WHILE), None)
        if not_while is not None:
            raise _NoShrinkError(
                ShrinkFallback.NO_DEVICE_CHOICE,
                f"the loops run as {not_while.kind.name} here ({not_while.fallback_reason or 'asked for'})",
            )
        buffers = self._buffers
        try:
            return DeviceLoop.shrinking(loops, rows=LoopRows(buffers.active, rows, buffers.tokens, FINISHED))
        except CaptureError as error:
            raise _NoShrinkError(ShrinkFallback.NO_DEVICE_CHOICE, str(error)) from None
        except ValueError as error:  # a buffer of ours, the builder's or the decode loop's: named
            raise ValueError(_named(str(error), names)) from None

    def _request_rows(self) -> tuple[list[str], tuple[torch.Tensor, ...]]:
        """What moves with the requests, and its names: the static inputs with rows, the builder's
        ``request_rows()``, ``DecodeLoop.request_rows``; ``_NoShrinkError`` where that is not known."""
        extra = self._buffers.config.request_rows
        named = [(f"input {b.name!r}", b.tensor) for b in self._parts.buffers.buffers if b.rows is not None]
        builder = self._parts.builder
        if builder is not None:
            method = getattr(builder, "request_rows", None)
            declared = method() if callable(method) else None
            if declared is None:
                raise _NoShrinkError(
                    ShrinkFallback.NO_ROW_ORDER,
                    f"the attention builder {type(builder).__name__} does not say which of its buffers hold "
                    "a row per request (request_rows())",
                )
            named += [(f"{type(builder).__name__}.request_rows()[{i}]", t) for i, t in enumerate(declared)]
        named += [(f"options.decode_loop.request_rows[{i}]", t) for i, t in enumerate(extra)]
        return [name for name, _ in named], tuple(t for _, t in named)

    def _note(self, fallback: ShrinkFallback, detail: str) -> None:
        """Log why a class of loops does not shrink, once per reason (INFO: a choice; WARNING: the device)."""
        if fallback in self._logged:
            return
        self._logged.add(fallback)
        level = logging.WARNING if fallback is ShrinkFallback.NO_DEVICE_CHOICE else logging.INFO
        _logger.log(
            level, "decode loops do not shrink (%s): %s; each runs on its first key", fallback.value, detail
        )


def iteration(
    parts: ManagerParts[OutputT],
    inputs: Mapping[str, torch.Tensor],
    context: ForwardContext,
    state: LoopState,
    output: OutputT | None = None,
) -> None:
    """One iteration in ``context``: the forward (unless a replay gave ``output``), then the advance."""
    assert parts.loop is not None
    restore = FORWARD_CONTEXT_VAR.set(context)
    try:
        out = parts.model(**inputs) if output is None else output
        parts.loop.config.advance(out, inputs, state)
    finally:
        FORWARD_CONTEXT_VAR.reset(restore)


class _NoShrinkError(Exception):
    """Why a class of loops does not shrink."""

    def __init__(self, fallback: ShrinkFallback, detail: str) -> None:
        super().__init__(detail)
        self.fallback: Final = fallback
        self.detail: Final = detail


def _classes(loops: dict[BatchDescriptor, DeviceLoop]) -> Iterable[list[BatchDescriptor]]:
    """The keys with a loop, grouped by class, each group ascending."""
    grouped: dict[_Class, list[BatchDescriptor]] = {}
    for key in loops:
        grouped.setdefault((key.uniform, key.has_lora, key.num_active_loras), []).append(key)
    return [sorted(keys, key=lambda k: k.num_tokens) for keys in grouped.values()]


def _named(message: str, names: Sequence[str]) -> str:
    """A shrinking loop's error about ``rows.buffers[i]`` with the buffer's name instead."""
    return re.sub(r"rows\.buffers\[(\d+)\]", lambda m: names[int(m.group(1))], message)
