"""The decode loops' capture: one ``DeviceLoop`` per captured loopable graph, beside its one-step graph.

``capture()`` captures, after the keys, a loop (the model's forward, then the
``advance``) for every captured FULL graph with a request row per token, into
the same pool (docs/design.md, "Decode loops"). A loop that fails to capture
is logged: its ``run_loop`` loops on the host meanwhile; where a loop must
run on the device (its kind forced, or a strict manager), the failure raises.
"""

from __future__ import annotations

import logging
import time
from typing import Final, Generic

import torch

from cudagraph_capture import CaptureError, CaptureOptions, DeviceLoop
from cudagraph_dispatch import CUDAGraphMode, ForwardContext

from .._batch import StepBatch
from .._decode_loop import LoopBuffers
from .._graphs import GraphTable, PlannedGraph
from .._memory._device import RecordingBytes
from .._parts import ManagerParts
from .._protocols import OutputT
from .._reports._report import CapturedGraph
from .._step._loop import iteration, loop_metadata

_LOG: Final = logging.getLogger("cudagraph_manager")


class LoopCapture(Generic[OutputT]):
    """Records a manager's decode loops into its graph table, or (the estimate's probes) into a pool."""

    __slots__ = ("_buffers", "_parts", "_table")

    def __init__(
        self, parts: ManagerParts[OutputT], buffers: LoopBuffers[OutputT], table: GraphTable[OutputT]
    ) -> None:
        self._parts: Final = parts
        self._buffers: Final = buffers
        self._table: Final = table

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

    def capture_missing(self, options: CaptureOptions) -> list[CapturedGraph]:
        """Capture the loop of every captured loopable graph that has none; a failure is logged.

        Unless the loop must run on the device (a forced ``LoopKind``, or a
        strict manager): then the failure raises, as a key's capture does.
        """
        captured = []
        must = self._parts.strict or self._buffers.config.policy.kind is not None
        for graph in self.missing(captured_only=True):
            try:
                loop, record = self.record(graph, options)
            except CaptureError as error:
                if must:
                    raise
                _LOG.warning(
                    "decode loop of %s not captured, its run_loop loops on the host: %s",
                    graph.descriptor,
                    error,
                )
                continue
            self._table.keep_loop(graph.descriptor, loop)
            captured.append(record)
        return captured

    def record(
        self, graph: PlannedGraph[OutputT], options: CaptureOptions
    ) -> tuple[DeviceLoop, CapturedGraph]:
        """``graph``'s loop recorded into ``options``' pool, not kept, and what it cost."""
        start = time.perf_counter()
        parts, buffers = self._parts, self._buffers
        parts.buffers.fill_padding(graph.num_tokens, graph.num_reqs)
        extra = loop_metadata(parts, StepBatch.padding(), graph.shape)  # valid values for the warm-up
        buffers.reset(0, graph.num_reqs)  # the warm-up's rows are all padding
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
            )
        seconds = time.perf_counter() - start
        return loop, CapturedGraph(
            CUDAGraphMode.FULL, graph.descriptor, seconds, cost.pool, cost.driver, loop=True
        )
