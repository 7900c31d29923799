"""Steps without a graph: counted per reason, logged once per reason, refused in strict mode.

The step path decides that a step replays nothing; this module says why
(``EagerReason``) and runs it: the model on the batch as it is, or, on a
device without CUDA graphs, the step the graph would replay, run eagerly on
the padded static buffers and cut like a replay's outputs. Idle steps (0
tokens) and an idle rank's part in the others' eager step are here too. A
step is counted once it ran: a refused or failed one never is.
"""

from __future__ import annotations

import logging
from typing import Final, Generic, cast

import torch

from cudagraph_dispatch import (
    BatchDescriptor,
    CUDAGraphMode,
    Dispatch,
    EagerReason,
    Route,
    set_forward_context,
)

from .._attention._seam import metadata_extra
from .._graphs._table import PlannedGraph
from .._parts import ManagerParts
from .._values._batch import BatchShape, StepBatch
from .._values._protocols import CaptureState, OutputT
from ..ranks import NUM_TOKENS_ACROSS_DP
from ._plan import NoGraphError

_logger: Final = logging.getLogger("cudagraph_manager")
_NONE: Final = CUDAGraphMode.NONE


class EagerSteps(Generic[OutputT]):
    """Runs the model for the steps that replay no graph, and counts them.

    ``captures`` says why a planned graph has no entry (released, or a
    background capture still running).
    """

    __slots__ = ("_captures", "_logged", "_parts")

    def __init__(self, parts: ManagerParts[OutputT], captures: CaptureState) -> None:
        self._parts: Final = parts
        self._captures: Final = captures
        self._logged: Final[set[EagerReason]] = set()

    def without_graph(
        self,
        batch: StepBatch,
        route: Route,
        graph: PlannedGraph[OutputT] | None,
        dummy: bool,
        everywhere: bool = False,
    ) -> OutputT:
        """A step that replays nothing: an idle rank's part, or an eager step for its reason.

        A route without a graph is its own reason; a planned graph without an
        entry is ``not_captured``, or ``no_cuda`` where nothing can be
        captured, or ``released``; a key missed while a capture thread runs
        is reported to it (captured next) and allowed in strict mode.
        ``graph``: the planned graph of this rank's batch (with ranks, the
        agreed route may run another step: it names the reason only).
        ``dummy``: an idle rank runs a dummy step along with the others'.
        ``everywhere``: the step's exchange saw every rank's lockstep capture
        running; strict mode then runs it (the allowance comes from the
        exchange, so every rank runs or every rank raises).
        """
        if batch.num_tokens == 0:  # an idle step (EMPTY_BATCH), or an idle rank's part in the others'
            return self.dummy_step(everywhere) if dummy else self.idle(batch)
        reason = route if isinstance(route, EagerReason) else EagerReason.NOT_CAPTURED
        if reason is EagerReason.NOT_CAPTURED:
            if self._parts.no_graphs is not None:  # the ranks' route says "not captured" for it too
                reason = EagerReason.NO_CUDA
            elif self._captures.released:
                reason = EagerReason.RELEASED
            elif graph is not None and (session := self._captures.thread_capture()) is not None:
                session.missed(graph.descriptor)  # captured next; the first recording waits for served()
                try:
                    return self.run(batch, reason, graph, allowed=True)
                finally:
                    session.served()
        padded = graph if isinstance(route, Dispatch) else None  # no CUDA: the step the route's graph is
        return self.run(batch, reason, graph, allowed=everywhere, padded=padded)

    def run(
        self,
        batch: StepBatch,
        reason: EagerReason,
        graph: PlannedGraph[OutputT] | None,
        *,
        allowed: bool = False,
        padded: PlannedGraph[OutputT] | None = None,
    ) -> OutputT:
        """The model run eagerly for ``reason`` (``graph``: the planned graph of the batch, for the reason).

        ``padded``: without CUDA, the graph whose step runs eagerly on the
        padded buffers (the route's; with ranks, never: each rank its batch).

        Raises:
            NoGraphError: in strict mode, unless ``allowed`` (its key is
                being captured by a running background capture).
        """
        parts = self._parts
        if parts.strict and not allowed:
            raise NoGraphError(batch.num_tokens, self._why(reason, graph, batch))
        if reason is EagerReason.NO_CUDA and padded is not None:
            out = self._padded(batch, padded)
        else:  # the batch as it is: an attention may lay out a uniform batch per request
            with torch.no_grad(), self._context(batch.eager_descriptor(), batch, batch.eager_shape()):
                out = parts.model(**batch.inputs)
            # The outputs of an eager step are checked as a capture's are (rows, structure):
            # a wrong output never reaches the caller silently. Eager steps only.
            parts.layout.of(out).check(out, batch.num_tokens, batch.num_reqs)
        self._counted(reason, graph, batch)
        return out

    def _counted(self, reason: EagerReason, graph: PlannedGraph[OutputT] | None, batch: StepBatch) -> None:
        """An eager step that ran, counted and logged (once per reason); a refused or failed one never is."""
        if reason not in self._logged:  # once per reason: visible, never a flood
            self._logged.add(reason)
            level = logging.INFO if reason is EagerReason.NO_CUDA else logging.WARNING
            why = self._why(reason, graph, batch)
            _logger.log(
                level, "running a step of %d tokens eagerly (%s): %s", batch.num_tokens, reason.value, why
            )
        self._parts.counts.eager_step(reason)

    def idle(self, batch: StepBatch) -> OutputT:
        """A step of 0 tokens: the outputs' structure with no rows; the model never sees empty inputs.

        A manager that has seen no outputs yet (no capture, no step) learns
        their structure once, from the model on one padding row of the static
        buffers (the pad values, as a warm-up runs it; not counted as a step).
        """
        cell = self._parts.layout
        if cell.layout is None:
            self._padding_row()  # sets the layout
        layout = cell.layout
        assert layout is not None
        self._parts.counts.idle()
        return cast(OutputT, layout.empty())

    def dummy_step(self, everywhere: bool = False) -> OutputT:
        """An idle rank's part in an eager step of the others: the model once on one padding row.

        Outputs with 0 rows; counted in ``stats.dummy_steps``; strict raises
        (as every rank does), unless the step's exchange saw every rank's
        lockstep capture running (``everywhere``).
        """
        parts = self._parts
        if parts.strict and not everywhere:
            raise NoGraphError(0, f"the other ranks of the {_world_size(parts)} run this step eagerly")
        out = self._padding_row()
        parts.counts.dummy()
        return out

    def _padding_row(self) -> OutputT:
        """The model on one padding row (the static buffers' pad values), its outputs cut to 0 rows."""
        parts = self._parts
        parts.buffers.fill_padding(1, 1)
        padding = StepBatch.padding()
        with torch.no_grad(), self._context(BatchDescriptor(1), padding, BatchShape.eager(1, 1, False)):
            out = parts.model(**parts.buffers.views(1, 1))
        layout = parts.layout.of(out)
        layout.check(out, 1, 1)
        return cast(OutputT, layout.cut(out, 0, 0))

    def _padded(self, batch: StepBatch, graph: PlannedGraph[OutputT]) -> OutputT:
        """No CUDA graphs here: the step ``graph`` would replay, run on the padded static buffers."""
        parts = self._parts
        with torch.no_grad(), self._context(graph.descriptor, batch, graph.eager_shape):  # the copies too
            parts.buffers.copy_in(
                batch.inputs, batch.num_tokens, batch.num_reqs, graph.num_tokens, graph.num_reqs
            )
            padded = parts.model(**graph.inputs)
        layout = parts.layout.of(padded)
        layout.check(padded, graph.num_tokens, graph.num_reqs)
        parts.counts.padded(graph.num_tokens - batch.num_tokens)
        return cast(OutputT, layout.cut(padded, batch.num_tokens, batch.num_reqs))

    def _context(
        self, descriptor: BatchDescriptor, batch: StepBatch, shape: BatchShape
    ) -> set_forward_context:
        """The eager forward's context: NONE, its key, the attention's metadata of ``batch`` as ``shape``.

        With ranks, ``extra[NUM_TOKENS_ACROSS_DP]`` (``"num_tokens_across_dp"``,
        vLLM's name): every rank's token count in this step's exchange, by rank.
        """
        parts = self._parts
        builder, ranks = parts.builder, parts.ranks
        if builder is None and ranks is None:
            return set_forward_context(_NONE, descriptor)
        extra = {} if builder is None else metadata_extra(builder, builder.build(batch, shape))
        if ranks is not None:  # every rank's count, agreed this step: a model's collectives need no exchange
            extra[NUM_TOKENS_ACROSS_DP] = ranks.num_tokens_across_dp
        return set_forward_context(_NONE, descriptor, **extra)

    def _why(self, reason: EagerReason, graph: PlannedGraph[OutputT] | None, batch: StepBatch) -> str:
        """A step's eager reason in words (for logs and errors)."""
        parts = self._parts
        if reason is EagerReason.NO_CUDA:
            return parts.no_graphs or "no CUDA graphs on this device"
        if reason is EagerReason.NOT_CAPTURED and graph is not None:
            what = f"its {graph.mode.name} graph {graph.descriptor} was not captured yet"
            if self._captures.thread_capture() is not None:
                return f"{what}: a background capture (start_capture()) is running and captures it next"
            if self._captures.running() is not None:
                return (
                    f"{what}: a lockstep capture (start_capture() with ranks) is running; the steps capture "
                    "the keys any rank misses, and the graphs switch in once every rank has every key"
                )
            return f"{what}; call capture() first"
        if reason is EagerReason.RELEASED:
            return "its graphs were released (release()); start_capture() or capture() brings them back"
        if reason is EagerReason.OTHER_RANK and parts.ranks is not None:
            return f"another rank of the {parts.ranks.world_size} runs this step without a graph, so all do"
        return parts.dispatcher.explain(
            batch.num_tokens,
            uniform_decode=batch.uniform_decode,
            num_active_loras=batch.num_active_loras,
            invalid_modes=batch.invalid_modes,
        )


def _world_size(parts: ManagerParts[OutputT]) -> int | None:
    return None if parts.ranks is None else parts.ranks.world_size
