"""The step path of ``run()``: check, route, build the metadata, copy in, replay, count and cut.

One screen, as SGLang's ``replay_prepare`` -> ``replay``: the inputs are
checked into the step's one value (``StepBatch``), routed to a planned
graph, copied into its static views and replayed; a route without a graph
goes to the eager steps. ``run_loop`` takes the same check, route and copy in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Generic, cast

import torch

from cudagraph_capture.lowlevel import OutputGuard
from cudagraph_dispatch import CUDAGraphMode, Dispatch, Route, StepRequest
from cudagraph_dispatch.lowlevel import FORWARD_CONTEXT_VAR, NO_MODES

from .._graphs._table import GraphTable, PlannedGraph
from .._memory._weights import WeightWatch
from .._parts import ManagerParts
from .._values._batch import StepBatch
from .._values._protocols import OutputT, StepHook
from ..ranks import RankAgreement
from ._eager import EagerSteps


class StepPath(Generic[OutputT]):
    """One manager's steps: the route of each to its planned graph, the replay, or an eager step."""

    __slots__ = (
        "_buffers",
        "_counts",
        "_dispatcher",
        "_graphs",
        "_guard",
        "_hook",
        "_layout",
        "_ranks",
        "_table",
        "_weights",
        "eager",
    )

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        table: GraphTable[OutputT],
        eager: EagerSteps[OutputT],
        weights: WeightWatch,
        guard: OutputGuard | None,
        hook: StepHook | None = None,
    ) -> None:
        """``hook``: with ranks, what each step's exchange carries and what follows it (the lockstep's)."""
        self._buffers: Final = parts.buffers
        self._dispatcher: Final = parts.dispatcher
        self._counts: Final = parts.counts
        self._layout: Final = parts.layout  # from the first outputs seen
        self._ranks: Final[RankAgreement | None] = parts.ranks
        self._table: Final = table
        self._graphs: Final = table.graphs  # the one look-up per step
        self._weights: Final = weights
        self._guard: Final = guard
        self._hook: Final = hook
        self.eager: Final = eager

    def run(
        self,
        inputs: Mapping[str, torch.Tensor],
        uniform_decode: bool,
        loras: int,
        invalid: frozenset[CUDAGraphMode],
    ) -> OutputT:
        """One step: check -> route -> build -> copy in -> replay -> count and cut; or an eager step."""
        num_tokens, num_reqs, grad = self._buffers.check(inputs, uniform_decode, loras)
        if self._ranks is not None:  # one exchange: every rank takes the same route
            request = StepRequest(num_tokens, uniform_decode, loras, invalid)
            route, dummy, own, everywhere = self._agreed_route(request)
        else:  # 0 tokens route to EMPTY_BATCH: an idle step
            route = own = self._dispatcher.route(num_tokens, uniform_decode, loras, invalid)
            dummy = everywhere = False
        graph = self._graphs[route.descriptor] if isinstance(route, Dispatch) else None
        entry = None if graph is None else graph.entry  # read once: a background capture may store it
        if graph is None or entry is None:  # the step's value is built off the replay's path only
            batch = StepBatch(num_tokens, num_reqs, inputs, uniform_decode, loras, invalid, grad)
            planned = self._graphs[own.descriptor] if isinstance(own, Dispatch) else None  # for its reason
            return self.eager.without_graph(batch, route, planned, dummy, everywhere)
        if self._weights.needs_check():  # a tensor the graphs read was assigned, or the model moved
            self._weights.check()  # WeightsReplacedError names it, before a buffer is touched
        context = graph.context
        if graph.builder is not None:  # its metadata first: a builder refuses before a buffer is touched
            context = graph.build(
                StepBatch(num_tokens, num_reqs, inputs, uniform_decode, loras, invalid, grad)
            )
        self._buffers.copy_in(inputs, num_tokens, num_reqs, graph.num_tokens, graph.num_reqs, grad)
        if context is None:
            entry.replay()
        else:  # a PIECEWISE replay runs its eager breaks, which read the forward context
            token = FORWARD_CONTEXT_VAR.set(context)
            try:
                entry.replay()
            finally:
                FORWARD_CONTEXT_VAR.reset(token)
        out = graph.replayed(entry, self._layout.layout, num_tokens, num_reqs)
        self._counts.replayed(graph.num_tokens - num_tokens, dummy)
        return out if self._guard is None else cast(OutputT, self._guard.replayed(graph.descriptor, out))

    def route(self, batch: StepBatch) -> PlannedGraph[OutputT] | None:
        """The planned graph ``batch`` pads to, without ranks (``None``: it runs without one)."""
        route = self._dispatcher.route(
            batch.num_tokens, batch.uniform_decode, batch.num_active_loras, batch.invalid_modes
        )
        return self._graphs[route.descriptor] if isinstance(route, Dispatch) else None

    def check_weights(self) -> None:
        """``WeightsReplacedError`` if a tensor the graphs read was replaced (checked where one may be)."""
        if self._weights.needs_check():
            self._weights.check()

    def idle_step(self) -> None:
        """A step of 0 tokens (with ranks: its exchange; this rank's dummy step where others have tokens)."""
        self.run(self._buffers.views(0, 0), False, 0, NO_MODES)

    def _agreed_route(self, request: StepRequest) -> tuple[Route, bool, Route, bool]:
        """The route every rank takes (one exchange), whether this rank runs a dummy step along, its own
        route, and whether strict mode runs an eager step (every rank's lockstep capture was running).

        The hook's field rides on the exchange; its turn (a lockstep capture's keys) follows it, before
        the step, whose route was agreed on the graphs as they were.
        """
        ranks, hook = self._ranks, self._hook
        assert ranks is not None
        field = () if hook is None else hook.field()
        step = ranks.route_step(self._dispatcher, request, can_replay=self._table.all_captured, field=field)
        everywhere = hook is not None and hook.stepped(step.fields)
        return step.route, step.dummy, step.own, everywhere
