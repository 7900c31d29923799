"""The step path of ``run()``: check, route, build the metadata, copy in, replay, count and cut.

One screen, as SGLang's ``replay_prepare`` -> ``replay``: the inputs are
checked, routed to a planned graph, copied into its static views and
replayed. That is the replay's fast path, with no plan built; a step whose
route has no captured graph, and with ranks every step, asks the planner
(``_plan``) how it runs, and an eager step goes to the eager steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Generic, cast

import torch

from cudagraph_capture import GraphEntry
from cudagraph_capture._guard import OutputGuard
from cudagraph_dispatch import CUDAGraphMode, Dispatch
from cudagraph_dispatch._context import FORWARD_CONTEXT_VAR
from cudagraph_dispatch._request import NO_MODES
from cudagraph_dispatch._rule import Route

from .._graphs._table import GraphTable, PlannedGraph
from .._memory._weights import WeightWatch
from .._parts import ManagerParts
from .._values._batch import StepBatch
from .._values._protocols import OutputT
from ._eager import EagerSteps
from ._plan import Planner


class StepPath(Generic[OutputT]):
    """One manager's steps: the replay of each route's captured graph, or the step its plan says."""

    __slots__ = (
        "_buffers",
        "_counts",
        "_dispatcher",
        "_graphs",
        "_guard",
        "_layout",
        "_planner",
        "_ranks",
        "_weights",
        "eager",
    )

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        table: GraphTable[OutputT],
        planner: Planner[OutputT],
        weights: WeightWatch,
        guard: OutputGuard | None,
    ) -> None:
        self._buffers: Final = parts.buffers
        self._dispatcher: Final = parts.dispatcher
        self._counts: Final = parts.counts
        self._layout: Final = parts.layout  # from the first outputs seen
        self._ranks: Final = parts.ranks
        self._graphs: Final = table.graphs  # the one look-up per step
        self._planner: Final = planner
        self._weights: Final = weights
        self._guard: Final = guard
        self.eager: Final = EagerSteps(parts, planner)

    def run(
        self,
        inputs: Mapping[str, torch.Tensor],
        uniform_decode: bool,
        loras: int,
        invalid: frozenset[CUDAGraphMode],
    ) -> OutputT:
        """One step: check -> route -> build -> copy in -> replay -> count and cut; or its plan's step."""
        num_tokens, num_reqs, grad = self._buffers.check(inputs, uniform_decode, loras)
        route: Route | None
        graph: PlannedGraph[OutputT] | None
        entry: GraphEntry[OutputT] | None
        if self._ranks is None:  # 0 tokens route to EMPTY_BATCH: an idle step
            route = self._dispatcher.route(num_tokens, uniform_decode, loras, invalid)
            graph = self._graphs[route.descriptor] if isinstance(route, Dispatch) else None
            entry = None if graph is None else graph.entry  # read once: a background capture may store it
        else:  # the plan routes, over the step's exchange
            route = graph = entry = None
        batch: StepBatch | None = None  # the step's one value, built off the replay's fast path only
        dummy = False
        if graph is None or entry is None:  # with ranks every step, else a route without a captured graph
            batch = StepBatch(num_tokens, num_reqs, inputs, uniform_decode, loras, invalid, grad)
            plan = self._planner.plan(batch, route)
            if plan.graph is None or plan.entry is None:
                return self.eager.run(plan)
            graph, entry, dummy = plan.graph, plan.entry, plan.dummy
        if self._weights.needs_check():  # a tensor the graphs read was assigned, or the model moved
            self._weights.check()  # WeightsReplacedError names it, before a buffer is touched
        context = graph.context
        if graph.builder is not None:  # its metadata first: a builder refuses before a buffer is touched
            if batch is None:
                batch = StepBatch(num_tokens, num_reqs, inputs, uniform_decode, loras, invalid, grad)
            context = graph.build(batch)
        self._buffers.copy_in(inputs, num_tokens, num_reqs, graph.num_tokens, graph.num_reqs, grad)
        if context is None:
            entry.replay()
        else:  # a PIECEWISE replay runs its eager breaks, which read the forward context
            restore = FORWARD_CONTEXT_VAR.set(context)
            try:
                entry.replay()
            finally:
                FORWARD_CONTEXT_VAR.reset(restore)
        out = graph.replayed(entry, self._layout.layout, num_tokens, num_reqs)
        self._counts.replayed(graph.num_tokens - num_tokens, dummy)
        return out if self._guard is None else cast(OutputT, self._guard.replayed(graph.descriptor, out))

    def check_weights(self) -> None:
        """``WeightsReplacedError`` if a tensor the graphs read was replaced (checked where one may be)."""
        if self._weights.needs_check():
            self._weights.check()

    def idle_step(self) -> None:
        """A step of 0 tokens (with ranks: its exchange; this rank's dummy step where others have tokens)."""
        self.run(self._buffers.views(0, 0), False, 0, NO_MODES)
