"""Steps without a graph: the model run for a step plan that replays nothing.

The plan (``_plan``) says why a step replays nothing; this module runs it:
the model on the batch as it is, or, on a device without CUDA graphs, the
step the graph would replay, run eagerly on the padded static buffers and
cut like a replay's outputs. Idle steps (0 tokens) and an idle rank's part
in the others' eager step are here too. A step is counted once it ran: a
refused or failed one never is.
"""

from __future__ import annotations

import contextvars
from typing import Final, Generic, cast

import torch

from cudagraph_dispatch import BatchDescriptor, ForwardContext
from cudagraph_dispatch._context import FORWARD_CONTEXT_VAR

from .._graphs._table import PlannedGraph
from .._parts import ManagerParts
from .._values._batch import BatchShape, StepBatch
from .._values._protocols import OutputT
from ._plan import NoGraphError, Planner, StepPlan

#: A dummy step's one padding row: its key, and the shape the attention sees it as.
_ONE_ROW: Final = BatchDescriptor(1)
_ONE_ROW_SHAPE: Final = BatchShape.eager(1, 1, False)


class EagerSteps(Generic[OutputT]):
    """Runs the model for the step plans that replay no graph, and counts them."""

    __slots__ = ("_parts", "_planner")

    def __init__(self, parts: ManagerParts[OutputT], planner: Planner[OutputT]) -> None:
        self._parts: Final = parts
        self._planner: Final = planner

    def run(self, plan: StepPlan[OutputT]) -> OutputT:
        """``plan``'s step, which replays nothing: an idle step, an idle rank's part, or an eager step.

        Raises:
            NoGraphError: in strict mode, unless the plan allows the step.
        """
        batch = plan.batch
        if self._parts.strict and not plan.allowed:
            raise NoGraphError(batch.num_tokens, self._planner.why(plan))
        if batch.num_tokens == 0:  # an idle step (EMPTY_BATCH), or an idle rank's part in the others'
            return self.dummy_step() if plan.dummy else self.idle()
        capture = plan.capture
        if capture is not None and plan.graph is not None:
            capture.missed(plan.graph.descriptor)  # captured next; its first recording waits for served()
        try:
            if plan.padded and plan.graph is not None:
                out = self._padded(plan, plan.graph)
            else:  # the batch as it is: an attention may lay out a uniform batch per request
                with torch.no_grad(), _entered(self._planner.context(plan)):
                    out = self._parts.model(**batch.inputs)
                # The outputs of an eager step are checked as a capture's are (rows, structure):
                # a wrong output never reaches the caller silently. Eager steps only.
                self._parts.layout.of(out).check(out, batch.num_tokens, batch.num_reqs)
        finally:
            if capture is not None:
                capture.served()
        self._planner.ran(plan)
        return out

    def idle(self) -> OutputT:
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

    def dummy_step(self) -> OutputT:
        """An idle rank's part in an eager step of the others: the model once on one padding row.

        Outputs with 0 rows; counted in ``stats.dummy_steps``.
        """
        out = self._padding_row()
        self._parts.counts.dummy()
        return out

    def _padding_row(self) -> OutputT:
        """The model on one padding row (the static buffers' pad values), its outputs cut to 0 rows."""
        parts = self._parts
        parts.buffers.fill_padding(1, 1)
        with (
            torch.no_grad(),
            _entered(self._planner.forward_context(_ONE_ROW, StepBatch.padding(), _ONE_ROW_SHAPE)),
        ):
            out = parts.model(**parts.buffers.views(1, 1))
        layout = parts.layout.of(out)
        layout.check(out, 1, 1)
        return cast(OutputT, layout.cut(out, 0, 0))

    def _padded(self, plan: StepPlan[OutputT], graph: PlannedGraph[OutputT]) -> OutputT:
        """No CUDA graphs here: the step ``graph`` would replay, run on the padded static buffers."""
        parts, batch = self._parts, plan.batch
        with torch.no_grad(), _entered(self._planner.context(plan)):  # the copies too
            parts.buffers.copy_in(
                batch.inputs, batch.num_tokens, batch.num_reqs, graph.num_tokens, graph.num_reqs
            )
            padded = parts.model(**graph.inputs)
        layout = parts.layout.of(padded)
        layout.check(padded, graph.num_tokens, graph.num_reqs)
        parts.counts.padded(graph.num_tokens - batch.num_tokens)
        return cast(OutputT, layout.cut(padded, batch.num_tokens, batch.num_reqs))


class _entered:  # noqa: N801 - used as a function-style context manager
    """``context`` is the forward context inside the block (the one before it is restored after)."""

    __slots__ = ("_context", "_restore")

    def __init__(self, context: ForwardContext) -> None:
        self._context: Final = context
        self._restore: contextvars.Token[ForwardContext | None] | None = None

    def __enter__(self) -> None:
        self._restore = FORWARD_CONTEXT_VAR.set(self._context)

    def __exit__(self, *exc: object) -> None:
        assert self._restore is not None
        FORWARD_CONTEXT_VAR.reset(self._restore)
