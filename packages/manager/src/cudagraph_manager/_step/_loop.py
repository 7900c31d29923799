"""``run_loop``: many decode steps per call, on the device where its loop is captured, else on the host.

The batch takes the step path's check, route and copy in, then runs the
planned graph's captured ``DeviceLoop``; without one it loops on the host over
the same static buffers (the one-step graph replayed, or the model run
eagerly), reading the stop flag after each step: the same tokens, slower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Generic

import torch

from cudagraph_capture import GraphEntry
from cudagraph_dispatch import ForwardContext
from cudagraph_dispatch.lowlevel import FORWARD_CONTEXT_VAR, NO_MODES

from .._attention._seam import metadata_extra
from .._batch import BatchShape, StepBatch
from .._decode_loop import LoopBuffers, LoopResult, LoopState, check_loop_steps
from .._graphs import GraphTable, PlannedGraph
from .._parts import ManagerParts
from .._protocols import OutputT
from ._path import StepPath


class LoopSteps(Generic[OutputT]):
    """A manager's ``run_loop``: a checked uniform batch routed to its planned graph and looped."""

    __slots__ = ("_buffers", "_parts", "_path", "_table")

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        buffers: LoopBuffers[OutputT],
        table: GraphTable[OutputT],
        path: StepPath[OutputT],
    ) -> None:
        self._parts: Final = parts
        self._buffers: Final = buffers
        self._table: Final = table
        self._path: Final = path

    def run(
        self,
        given: Mapping[str, torch.Tensor] | None,
        named: Mapping[str, torch.Tensor],
        max_steps: int | None,
    ) -> LoopResult:
        """Up to ``max_steps`` steps of a uniform batch, ``given`` or ``named`` (checked as ``run`` does)."""
        if given is not None and named:
            raise ValueError("batch: pass the inputs as keywords or in one mapping, not both")
        steps = check_loop_steps(self._buffers.config, max_steps)
        inputs = named if given is None else given
        num_tokens, num_reqs, grad = self._parts.buffers.check(inputs, True)
        batch = StepBatch(num_tokens, num_reqs, inputs, True, 0, NO_MODES, grad)
        if batch.num_tokens == 0:  # an idle loop: no model call, no step
            return LoopResult(self._buffers.tokens[:0, :0], 0, None)
        graph, entry = self._route(batch)
        context, rows = self._start(batch, graph, entry)
        loop = None if graph is None or entry is None else self._table.loops.get(graph.descriptor)
        if loop is not None:
            loop.launch(steps)
            taken = int(loop.steps_taken)  # the one synchronization
        else:
            taken = self._host_loop(graph, entry, context, rows, steps)
        tokens = self._buffers.tokens[:taken, : batch.num_reqs]
        return LoopResult(tokens, taken, None if loop is None else loop.kind)

    def _route(self, batch: StepBatch) -> tuple[PlannedGraph[OutputT] | None, GraphEntry[OutputT] | None]:
        """The loopable planned graph ``batch`` pads to, and its entry as read once (``None``: none)."""
        graph = self._path.route(batch)
        largest = self._parts.dispatcher.config.capture_sizes.max
        if graph is None and batch.num_tokens > largest:  # the host loop runs on the static buffers
            raise ValueError(
                f"num_tokens: a decode loop runs on the static buffers, of at most {largest} tokens "
                f"(the largest capture size); got {batch.num_tokens} requests"
            )
        entry = None if graph is None else graph.entry  # read once: a background capture may store it
        if entry is not None:
            self._path.check_weights()  # WeightsReplacedError names it, before a buffer is touched
        if graph is None or not graph.loopable:
            return None, None
        return graph, entry

    def _start(
        self, batch: StepBatch, graph: PlannedGraph[OutputT] | None, entry: GraphEntry[OutputT] | None
    ) -> tuple[ForwardContext, tuple[int, int]]:
        """The loop's context (its metadata built first: it may refuse), the batch copied in, state reset.

        Returns the context and the rows the loop runs on: ``graph``'s, else the batch's own.
        """
        if graph is None:
            shape, descriptor = batch.eager_shape(), batch.eager_descriptor()
            rows = (batch.num_tokens, batch.num_reqs)
        else:
            shape = graph.shape if entry is not None else graph.eager_shape
            descriptor, rows = graph.descriptor, (graph.num_tokens, graph.num_reqs)
        context = ForwardContext(shape.mode, descriptor, loop_metadata(self._parts, batch, shape))
        with torch.no_grad():
            self._parts.buffers.copy_in(
                batch.inputs, batch.num_tokens, batch.num_reqs, *rows, batch.requires_grad
            )
            self._buffers.reset(batch.num_reqs, rows[1])
        return context, rows

    def _host_loop(
        self,
        graph: PlannedGraph[OutputT] | None,
        entry: GraphEntry[OutputT] | None,
        context: ForwardContext,
        rows: tuple[int, int],
        max_steps: int,
    ) -> int:
        """The loop on the host: each step replayed (or run eagerly), advanced, its stop flag read back."""
        inputs = self._parts.buffers.views(*rows) if graph is None else graph.inputs
        buffers = self._buffers
        state = buffers.state(buffers.step, rows[1])
        with torch.no_grad():
            for step in range(max_steps):
                buffers.step.fill_(step)
                if entry is not None:
                    entry.replay()
                output = None if entry is None else entry.output
                iteration(self._parts, inputs, ForwardContext(*context), state, output)
                if bool(buffers.stop):  # the read-back a host loop pays every step
                    return step + 1
        return max_steps


def iteration(
    parts: ManagerParts[OutputT],
    inputs: Mapping[str, torch.Tensor],
    context: ForwardContext,
    state: LoopState,
    output: OutputT | None = None,
) -> None:
    """One iteration in ``context``: the forward (unless a replay gave ``output``), then the advance."""
    assert parts.loop is not None
    token = FORWARD_CONTEXT_VAR.set(context)
    try:
        out = parts.model(**inputs) if output is None else output
        parts.loop.config.advance(out, inputs, state)
    finally:
        FORWARD_CONTEXT_VAR.reset(token)


def loop_metadata(parts: ManagerParts[OutputT], batch: StepBatch, shape: BatchShape) -> Mapping[str, object]:
    """The loop's context extras: the attention's metadata of ``batch`` as ``shape`` (or none)."""
    builder = parts.builder
    return {} if builder is None else metadata_extra(builder, builder.build(batch, shape))
