"""The graph table: one ``PlannedGraph`` per key of the plan, read by every step and written by captures.

A planned graph's ``entry`` (the engine's ``GraphEntry``: graph, outputs,
replay) is the one place that says whether its key is captured: a capture
stores it in one assignment after checking its outputs, so the serving
thread replays it from its next step; ``drop()`` forgets it, which frees the
graph. ``GraphTable`` holds them in capture order, with the decode loops
captured for them; their state changes only through this module's methods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from types import MappingProxyType
from typing import Final, Generic, cast

from cudagraph_capture import DeviceLoop, GraphEntry
from cudagraph_dispatch import BatchDescriptor, CUDAGraphDispatcher, CUDAGraphMode, ForwardContext

from .._attention._seam import carried_extra, other_metadata
from .._memory._buffers import StaticBuffers
from .._memory._device import capture_lock_of
from .._memory._outputs import OutputLayout
from .._values._batch import BatchShape, StepBatch
from .._values._protocols import AttentionMetadataBuilder, OutputT


class PlannedGraph(Generic[OutputT]):
    """The graph of one planned key: its mode and key, row counts, input views, entry and replay counter."""

    __slots__ = (
        "builder",
        "context",
        "descriptor",
        "eager_shape",
        "entry",
        "inputs",
        "last_cut",
        "metadata_type",
        "mode",
        "num_reqs",
        "num_tokens",
        "replays",
        "shape",
    )

    def __init__(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        buffers: StaticBuffers,
        builder: AttentionMetadataBuilder[object] | None = None,
    ) -> None:
        self.mode: Final = mode
        self.descriptor: Final = descriptor
        self.num_tokens: Final = descriptor.num_tokens
        # PIECEWISE keys are relaxed (no request count): size their request rows as vLLM does.
        self.num_reqs: Final = (
            descriptor.num_reqs
            if descriptor.num_reqs is not None
            else min(self.num_tokens, buffers.max_num_seqs)
        )
        self.inputs: Final = buffers.views(self.num_tokens, self.num_reqs)  # the graph's keyword arguments
        #: The attention's view of the graph's batch, and of the same batch run eagerly (no CUDA).
        self.shape: Final = BatchShape.of_key(mode, descriptor, self.num_reqs)
        self.eager_shape: Final = dataclasses.replace(self.shape, mode=CUDAGraphMode.NONE)
        self.builder: Final = builder
        #: The type of the metadata the graph was recorded with (``build_for_capture``'s); a replay's
        #: ``build`` must return the same (the model reads it as the recording did).
        self.metadata_type: type | None = None
        # A PIECEWISE replay runs its eager breaks for real, and they may read the forward context.
        self.context: Final = ForwardContext(mode, descriptor) if mode is CUDAGraphMode.PIECEWISE else None
        #: The captured graph (``keep``), which replays itself; ``None``: not captured.
        self.entry: GraphEntry[OutputT] | None = None
        self.replays = 0
        # The last (entry, num_tokens, num_reqs, cut): steps of one row count reuse the cut.
        self.last_cut: tuple[GraphEntry[OutputT], int, int, object] | None = None

    @property
    def loopable(self) -> bool:
        """Whether a decode loop is captured for it: a FULL graph with a request row per token.

        A uniform key of one token per request, or (mode FULL, which plans no
        uniform keys) an exact key of as many requests as tokens.
        """
        return self.mode is CUDAGraphMode.FULL and self.num_reqs == self.num_tokens

    def build(self, batch: StepBatch) -> ForwardContext | None:
        """The attention's metadata of ``batch`` padded to this graph; the context its replay runs under.

        FULL: ``None`` (the graph reads the builder's buffers). PIECEWISE: the
        graph's context carrying the metadata, which the eager attention reads.
        """
        builder = self.builder
        assert builder is not None
        metadata = builder.build(batch, self.shape)
        if type(metadata) is not self.metadata_type:  # the seam's one check of the product: no call
            raise ValueError(other_metadata(builder, metadata, self.metadata_type))
        context = self.context
        if context is None:
            return None
        return ForwardContext(
            context.runtime_mode, self.descriptor, MappingProxyType(carried_extra(builder, metadata))
        )

    def recorded_with(self, metadata: object) -> None:
        """Note the type of the metadata the recording reads (``build_for_capture``'s), for replays."""
        self.metadata_type = type(metadata)

    def keep(self, entry: GraphEntry[OutputT]) -> None:
        """Store a checked entry: the key is captured, and replays from the serving thread's next step."""
        self.last_cut = None
        self.entry = entry  # last, one assignment: the serving thread sees uncaptured or captured

    def replayed(
        self, entry: GraphEntry[OutputT], layout: OutputLayout | None, num_tokens: int, num_reqs: int
    ) -> OutputT:
        """Count a replay of ``entry`` (this graph's); its outputs cut to the real rows.

        The outputs come in a fresh container (a caller's edits stay theirs).
        ``layout`` is set by the capture of every captured graph.
        """
        self.replays += 1
        assert layout is not None
        last = self.last_cut
        if last is not None and last[0] is entry and last[1] == num_tokens and last[2] == num_reqs:
            cut = last[3]
        else:
            cut = layout.cut(entry.output, num_tokens, num_reqs)
            self.last_cut = (entry, num_tokens, num_reqs, cut)
        return cast(OutputT, cut.copy() if isinstance(cut, (list, dict)) else cut)

    def replayed_steps(self, steps: int) -> None:
        """Count ``steps`` replays that return no outputs to cut (the steps of a loop on the host)."""
        self.replays += steps

    def drop(self) -> None:
        """Forget the entry (which frees the graph); the caller holds the device's capture lock."""
        self.entry = self.last_cut = None


class GraphTable(Generic[OutputT]):
    """The plan's graphs in capture order, and the decode loops captured for them.

    ``graphs`` maps each key of the dispatcher's plan to its ``PlannedGraph``;
    ``loops`` each key with a captured decode loop to it.
    """

    __slots__ = ("_device", "graphs", "loops")

    def __init__(
        self,
        dispatcher: CUDAGraphDispatcher,
        buffers: StaticBuffers,
        builder: AttentionMetadataBuilder[object] | None,
    ) -> None:
        self._device: Final = buffers.device
        self.graphs: Final = {
            key: PlannedGraph[OutputT](mode, key, buffers, builder)
            for mode, keys in dispatcher.capture_plan()
            for key in keys
        }
        self.loops: Final[dict[BatchDescriptor, DeviceLoop]] = {}

    def pending(self) -> list[PlannedGraph[OutputT]]:
        """The graphs not captured yet, in capture order."""
        return [graph for graph in self.graphs.values() if graph.entry is None]

    @property
    def num_captured(self) -> int:
        return sum(graph.entry is not None for graph in self.graphs.values())

    @property
    def all_captured(self) -> bool:
        return all(graph.entry is not None for graph in self.graphs.values())

    def replays_by_size(self) -> dict[tuple[CUDAGraphMode, int], int]:
        """Replays per (mode, num_tokens) (graphs of one size differ by requests or adapters)."""
        replays: dict[tuple[CUDAGraphMode, int], int] = {}
        for graph in self.graphs.values():
            if graph.replays:
                size = (graph.mode, graph.num_tokens)
                replays[size] = replays.get(size, 0) + graph.replays
        return replays

    def reset_replays(self) -> None:
        for graph in self.graphs.values():
            graph.replays = 0

    def keep_loop(self, descriptor: BatchDescriptor, loop: DeviceLoop) -> None:
        """Store the decode loop captured for ``descriptor``'s graph: its ``run_loop`` runs it from now."""
        self.loops[descriptor] = loop

    def drop(self, graph: PlannedGraph[OutputT]) -> None:
        """Free ``graph``'s entry (its key is not captured any more), under the device's capture lock."""
        with capture_lock_of(self._device):
            graph.drop()

    def drop_all(self) -> None:
        """Free every graph and decode loop (the pool stays, for the graphs captured next)."""
        with capture_lock_of(self._device):
            self.loops.clear()
            for graph in self.graphs.values():
                graph.drop()


def by_mode(graphs: Iterable[PlannedGraph[OutputT]]) -> dict[CUDAGraphMode, list[PlannedGraph[OutputT]]]:
    """``graphs`` grouped by mode, each group in the order given (a plan's: largest first)."""
    grouped: dict[CUDAGraphMode, list[PlannedGraph[OutputT]]] = {}
    for graph in graphs:
        grouped.setdefault(graph.mode, []).append(graph)
    return grouped
