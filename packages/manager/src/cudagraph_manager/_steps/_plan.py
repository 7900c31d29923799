"""The step plan: which graph serves a step, or why none does, decided in one place.

``Planner.plan`` decides, for one step (a ``run``, an idle rank's dummy
step, a ``run_loop`` call), the planned graph its rows run on and the entry
that replays it, or the ``EagerReason`` it runs without one, whether strict
mode runs it all the same, and (``Planner.context``) the forward context the
forward runs under; it returns them as one value, ``StepPlan``. With ranks
the route comes from the step's exchange, after which a lockstep capture
takes its turn (``Lockstep.stepped``: its answer is the plan's strict
allowance). The words of a reason (``why``) and its log line (once per
reason) are here too; where strict mode refuses a plan (not ``allowed``),
the step that runs it raises ``NoGraphError`` with those words.

``StepPath.run`` replays a captured route without building a plan (the
replay's fast path: the plan's replay case, inline); every other step asks
for one. A plan is built off that path only, so it may cost what a
``NamedTuple`` costs.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Final, Generic, NamedTuple

from cudagraph_capture import DeviceLoop, GraphEntry
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, Dispatch, EagerReason, ForwardContext
from cudagraph_dispatch._request import RankRequest
from cudagraph_dispatch._rule import Route

from .._attention._seam import build_extra
from .._graphs._capturer import Capturer
from .._graphs._table import GraphTable, PlannedGraph
from .._graphs._thread import ThreadCapture
from .._parts import ManagerParts
from .._values._batch import BatchShape, StepBatch
from .._values._protocols import OutputT
from ..ranks import NUM_TOKENS_ACROSS_DP

_logger: Final = logging.getLogger("cudagraph_manager")
_NOT_CAPTURED: Final = EagerReason.NOT_CAPTURED
_NONE: Final = CUDAGraphMode.NONE


class NoGraphError(RuntimeError):
    """A ``strict`` manager was asked to run a batch that has no captured graph.

    Raised before any static buffer is touched. ``num_tokens`` is the batch's
    real token count and ``reason`` says why it has no graph (above the
    largest capture size, a mixed batch in ``FULL_DECODE_ONLY``, not captured
    yet, ...). A non-strict manager runs such batches eagerly and counts them.
    """

    def __init__(self, num_tokens: int, reason: str) -> None:
        super().__init__(f"strict mode: no CUDA graph for a batch of {num_tokens} tokens: {reason}")
        self.num_tokens = num_tokens
        self.reason = reason


class StepPlan(NamedTuple, Generic[OutputT]):
    """How one step runs: the graph that replays it, or why it runs without one.

    ``batch``: the step's one value. ``graph``: the planned graph the step is
    about: the route's where the step runs on its rows, else this rank's own
    key's (what the reason names); ``None`` where the batch has no key.
    ``entry``: ``graph``'s captured entry, which replays the step (``None``:
    no replay). ``reason``: why it runs without a graph (``None``: it
    replays, or a decode loop runs over ``entry``); ``EMPTY_BATCH`` for a step
    of 0 tokens. ``padded``: it runs on ``graph``'s rows (a replay, a decode
    loop, or without CUDA the step ``graph`` would replay, run eagerly),
    else on the batch's own. ``allowed``: strict mode runs it all the same
    (an idle step; a key a capture is taking: every rank's lockstep capture
    was running, or ``capture``, the capture thread, captures it next and is
    told of the miss, then that the step was served). ``dummy``: an idle
    rank's part in the other ranks' step. ``loop``: ``run_loop``'s plans only,
    ``graph``'s captured decode loop (``None``: the loop runs on the host).
    """

    batch: StepBatch
    graph: PlannedGraph[OutputT] | None
    entry: GraphEntry[OutputT] | None
    reason: EagerReason | None
    padded: bool
    allowed: bool
    dummy: bool = False
    capture: ThreadCapture | None = None
    loop: DeviceLoop | None = None


class Planner(Generic[OutputT]):
    """One manager's step plans, and the words, the log line and the refusal of each eager reason."""

    __slots__ = ("_builder", "_captures", "_dispatcher", "_graphs", "_logged", "_parts", "_ranks", "_table")

    def __init__(
        self, parts: ManagerParts[OutputT], table: GraphTable[OutputT], captures: Capturer[OutputT]
    ) -> None:
        self._parts: Final = parts
        self._dispatcher: Final = parts.dispatcher
        self._builder: Final = parts.builder
        self._ranks: Final = parts.ranks
        self._table: Final = table
        self._graphs: Final = table.graphs
        #: Why a planned graph has no entry (released, or a capture still running), and the lockstep.
        self._captures: Final = captures
        #: The (call, reason) pairs logged, once each: "run" or "run_loop", and the reason.
        self._logged: Final[set[tuple[str, EagerReason | None]]] = set()

    def plan(self, batch: StepBatch, route: Route | None = None, *, loop: bool = False) -> StepPlan[OutputT]:
        """How ``batch``'s step runs: the graph that replays it, or why it runs without one.

        Args:
            batch: the step's checked batch.
            route: the dispatcher's route of ``batch`` where the caller took it;
                ``None``: taken here, with ranks over the step's exchange (every
                rank takes the same route; a lockstep capture's turn follows).
            loop: ``run_loop``'s plan: the key's graph must be one a decode loop
                is captured beside, and the plan names its loop.

        Returns:
            A replay where the route's graph is captured (for ``loop``: with
            its decode loop, if captured), else the reason: the route's own,
            or, where a planned graph has no entry, ``no_cuda``, ``released`` or
            ``not_captured`` (a capture thread then takes the key next, and
            strict mode allows the step).
        """
        dummy = everywhere = False
        if route is not None:
            own = route
        elif self._ranks is None:
            route = own = self._route(batch)
        else:  # one exchange: every rank takes the same route; a lockstep capture's turn follows it
            route, own, dummy, everywhere = self._agreed(batch)
        graph = self._graphs[route.descriptor] if isinstance(route, Dispatch) else None
        if loop and graph is not None and not graph.loopable:  # no loop beside it: the batch's own rows
            return StepPlan(batch, graph, None, EagerReason.NO_GRAPH_FOR_BATCH, padded=False, allowed=False)
        entry = None if graph is None else graph.entry  # read once: a background capture may store it
        if graph is not None and entry is not None:
            device_loop = self._table.loops.get(graph.descriptor) if loop else None
            return StepPlan(batch, graph, entry, None, True, True, dummy, loop=device_loop)
        if own is not route:  # with ranks: this rank's own key is what its reason names
            graph = self._graphs[own.descriptor] if isinstance(own, Dispatch) else None
        if batch.num_tokens == 0:  # an idle step, or an idle rank's part in the others' step
            return StepPlan(
                batch, graph, None, EagerReason.EMPTY_BATCH, False, not dummy or everywhere, dummy
            )
        if isinstance(route, EagerReason) and route is not _NOT_CAPTURED:
            return StepPlan(batch, graph, None, route, padded=False, allowed=everywhere)
        reason = self._uncaptured()
        # On the key's rows: a loop's, and without CUDA the step the route's graph would replay.
        padded = isinstance(route, Dispatch) and (loop or reason is EagerReason.NO_CUDA)
        capture = None
        if not loop and reason is _NOT_CAPTURED and graph is not None:
            capture = self._captures.thread_capture()  # it captures the key next: strict allows the step
        return StepPlan(batch, graph, None, reason, padded, everywhere or capture is not None, False, capture)

    # -- the eager reason: words, log, refusal --

    def why(self, plan: StepPlan[OutputT], *, loop: bool = False) -> str:
        """``plan``'s reason in words, for its log line and its ``NoGraphError`` (``loop``: a loop's)."""
        reason, graph, parts = plan.reason, plan.graph, self._parts
        if plan.dummy and plan.entry is None:
            world_size = None if self._ranks is None else self._ranks.world_size
            return f"the other ranks of the {world_size} run this step eagerly"
        if reason is EagerReason.NO_CUDA:
            return parts.no_graphs or "no CUDA graphs on this device"
        if reason is None and graph is not None:  # a loop over a one-step graph
            return self._no_loop(graph)
        if reason is _NOT_CAPTURED and graph is not None:
            return self._not_captured(graph, loop=loop)
        if reason is EagerReason.RELEASED:
            then = (
                "capture() brings them and the loops back"
                if loop
                else "start_capture() or capture() brings them back"
            )
            return f"its graphs were released (release()); {then}"
        ranks = self._ranks
        if reason is EagerReason.OTHER_RANK and ranks is not None:
            return f"another rank of the {ranks.world_size} runs this step without a graph, so all do"
        if loop and reason is EagerReason.NO_GRAPH_FOR_BATCH and graph is not None:
            return (
                f"its key {graph.descriptor} is a {graph.mode.name} graph; a decode loop is captured "
                "beside a FULL graph with a request row per token"
            )
        batch = plan.batch
        return self._dispatcher.explain(
            batch.num_tokens,
            uniform_decode=batch.uniform_decode,
            num_active_loras=batch.num_active_loras,
            invalid_modes=batch.invalid_modes,
        )

    def ran(self, plan: StepPlan[OutputT]) -> None:
        """``plan``'s eager step ran: logged (once per reason) and counted (a refused or failed one never)."""
        reason = plan.reason
        assert reason is not None
        if ("run", reason) not in self._logged:
            self._log("run", plan, "running a step of %d tokens eagerly", plan.batch.num_tokens)
        self._parts.counts.eager_step(reason)

    def looping_on_host(self, plan: StepPlan[OutputT]) -> None:
        """``plan``'s decode loop is about to run on the host: logged (once per reason)."""
        if ("run_loop", plan.reason) not in self._logged:
            self._log("run_loop", plan, "run_loop of %d requests loops on the host", plan.batch.num_reqs)

    # -- the forward context --

    def context(self, plan: StepPlan[OutputT]) -> ForwardContext:
        """The forward context of ``plan``'s forward, off a replay: an eager step's, or a decode loop's.

        The rows it runs on (``graph``'s where ``padded``, else the batch's own)
        as the attention sees them: a graph's shape, or run eagerly.
        """
        graph, batch = plan.graph, plan.batch
        if plan.padded and graph is not None:
            shape = graph.shape if plan.entry is not None else graph.eager_shape
            return self.forward_context(graph.descriptor, batch, shape)
        return self.forward_context(batch.eager_descriptor(), batch, None)

    def forward_context(
        self, descriptor: BatchDescriptor, batch: StepBatch, shape: BatchShape | None
    ) -> ForwardContext:
        """``shape``'s mode and ``descriptor``, with the attention's metadata of ``batch`` as ``shape``.

        ``shape`` ``None``: ``batch`` run eagerly as it is (``batch.eager_shape()``,
        built only where an attention's builder reads it: host time per eager
        step). With ranks, ``extra[NUM_TOKENS_ACROSS_DP]``
        (``"num_tokens_across_dp"``, vLLM's name): every rank's token count in
        this step's exchange, by rank, so a model's collectives need no
        exchange of their own.
        """
        builder, ranks = self._builder, self._ranks
        if builder is None and ranks is None:
            return ForwardContext(_NONE if shape is None else shape.mode, descriptor)
        if shape is None and builder is not None:
            shape = batch.eager_shape()
        extra = {} if shape is None else build_extra(builder, batch, shape)
        if ranks is not None:
            extra[NUM_TOKENS_ACROSS_DP] = ranks.num_tokens_across_dp
        return ForwardContext(_NONE if shape is None else shape.mode, descriptor, MappingProxyType(extra))

    # -- the decisions' parts --

    def _route(self, batch: StepBatch) -> Route:
        return self._dispatcher.route(
            batch.num_tokens, batch.uniform_decode, batch.num_active_loras, batch.invalid_modes
        )

    def _agreed(self, batch: StepBatch) -> tuple[Route, Route, bool, bool]:
        """The route every rank takes (one exchange), this rank's own, whether it runs a dummy step, and
        whether the exchange saw every rank's lockstep capture running (strict then runs eager steps).

        The lockstep's field rides on the exchange; its turn (a lockstep capture's keys) follows it,
        before the step, whose route was agreed on the graphs as they were.
        """
        ranks, lockstep = self._ranks, self._captures.lockstep
        assert ranks is not None
        request = RankRequest(
            batch.num_tokens, batch.uniform_decode, batch.num_active_loras, batch.invalid_modes
        )
        field = () if lockstep is None else lockstep.field()
        step = ranks.route_step(self._dispatcher, request, can_replay=self._table.all_captured, field=field)
        everywhere = lockstep is not None and lockstep.stepped(step.fields)
        return step.route, step.own, step.dummy, everywhere

    def _uncaptured(self) -> EagerReason:
        """Why a planned graph has no entry: no CUDA here, released, or not captured (yet)."""
        if self._parts.no_graphs is not None:
            return EagerReason.NO_CUDA
        return EagerReason.RELEASED if self._captures.released else _NOT_CAPTURED

    def _not_captured(self, graph: PlannedGraph[OutputT], *, loop: bool) -> str:
        """Why ``graph`` has no entry yet, in words: which capture takes it, or which call would."""
        what = f"its {graph.mode.name} graph {graph.descriptor} was not captured yet"
        if loop:
            return f"{what}; capture() captures it and its loop"
        if self._captures.thread_capture() is not None:
            return f"{what}: a background capture (start_capture()) is running and captures it next"
        if self._captures.running() is not None:
            return (
                f"{what}: a lockstep capture (start_capture() with ranks) is running; the steps capture "
                "the keys any rank misses, and the graphs switch in once every rank has every key"
            )
        return f"{what}; call capture() first"

    def _no_loop(self, graph: PlannedGraph[OutputT]) -> str:
        """Why the captured ``graph`` has no decode loop, in words."""
        device = self._parts.device
        if device.type != "cuda":
            return f"decode loops are captured on a CUDA device only, and the manager's device is {device}"
        if self._captures.running() is not None:
            return f"{graph.descriptor}: a background capture captures one-step graphs; capture() the loops"
        return f"{graph.descriptor} has no decode loop: capture() captures it, or logged why it could not"

    def _log(self, call: str, plan: StepPlan[OutputT], what: str, count: int) -> None:
        """Log ``what`` (``count`` in it), the plan's reason and its words; ``call`` and reason, once each.

        INFO for ``no_cuda`` (a device without CUDA graphs: expected), WARNING
        otherwise: visible, never a flood.
        """
        reason = plan.reason
        self._logged.add((call, reason))
        key = "loop_not_captured" if reason is None else reason.value  # a loop over a one-step graph
        level = logging.INFO if reason is EagerReason.NO_CUDA else logging.WARNING
        _logger.log(level, f"{what} (%s): %s", count, key, self.why(plan, loop=call == "run_loop"))
