"""``run_loop``: many decode steps per call, on the device where its loop is captured, else on the host.

The batch takes the step path's checks (each error naming ``run_loop``) and
its plan (``Planner.plan(batch, loop=True)``), is copied in, then runs the
planned graph's captured ``DeviceLoop`` (a shrinking loop where its class
has one: it starts on the batch's key and moves to smaller ones as requests
finish, the tokens back in the caller's order); without one it loops on the
host over the same static buffers (the one-step graph replayed, or the model
run eagerly), reading the stop flag after each step: the same tokens,
slower. A loop on the host is logged once per reason and counted
(``stats.host_loop_steps``, and its replays or eager steps); ``strict``
refuses it, as ``run`` refuses an eager step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Generic

import torch

from cudagraph_dispatch import ForwardContext
from cudagraph_dispatch._request import NO_MODES

from .._graphs._loops import iteration
from .._memory._buffers import LoopBuffers
from .._parts import ManagerParts
from .._values._batch import StepBatch
from .._values._inputs import RESERVED_NAMES
from .._values._loop import LoopResult, check_loop_steps
from .._values._protocols import OutputT
from ._path import StepPath
from ._plan import NoGraphError, Planner, StepPlan


class LoopSteps(Generic[OutputT]):
    """A manager's ``run_loop``: a checked uniform batch, planned, copied in and looped."""

    __slots__ = ("_buffers", "_parts", "_path", "_planner")

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        buffers: LoopBuffers[OutputT],
        path: StepPath[OutputT],
        planner: Planner[OutputT],
    ) -> None:
        self._parts: Final = parts
        self._buffers: Final = buffers
        self._path: Final = path  # the weights' check
        self._planner: Final = planner

    def run(self, given: object, named: Mapping[str, object], max_steps: object) -> LoopResult:
        """Up to ``max_steps`` steps of a uniform batch, ``given`` or ``named`` (checked as ``run`` does).

        Raises ``ValueError`` starting with ``run_loop:`` for a bad argument,
        and ``NoGraphError`` in strict mode where it would loop on the host,
        before a buffer is touched or a step counted.
        """
        batch, steps = self._checked(given, named, max_steps)
        if batch.num_tokens == 0:  # an idle loop: no model call, no step
            self._parts.counts.idle()
            return LoopResult(self._buffers.tokens[:0, :0], 0, None)
        plan = self._plan(batch)
        context, rows = self._start(plan)
        loop = plan.loop
        if loop is not None:
            loop.launch(steps)
            taken, by_size = loop.read_steps()  # the one synchronization
            by_size = by_size or {rows[0]: taken}
        else:
            taken, by_size = self._host_loop(plan, context, rows, steps), {}
        self._count(plan, taken, by_size)
        tokens = self._buffers.tokens[:taken, : batch.num_reqs]
        return LoopResult(tokens, taken, None if loop is None else loop.kind)

    def _checked(
        self, given: object, named: Mapping[str, object], max_steps: object
    ) -> tuple[StepBatch, int]:
        """The batch of a ``run_loop`` call and its step limit; ``ValueError`` naming a bad argument."""
        inputs = loop_inputs(given, named)
        try:
            steps = check_loop_steps(self._buffers.config, max_steps)
            num_tokens, num_reqs, grad = self._parts.buffers.check(inputs, False)
        except ValueError as error:  # the step's checks say "run:"; these are run_loop's
            raise ValueError(f"run_loop: {str(error).removeprefix('run: ')}") from None
        if num_tokens != num_reqs:
            buffers = self._parts.buffers
            raise ValueError(
                f"run_loop: a decode loop's batch has one token per request; got {num_tokens} tokens "
                f"(input {buffers.first('tokens')!r}) for {num_reqs} requests "
                f"(input {buffers.first('reqs')!r})"
            )
        return StepBatch(num_tokens, num_reqs, inputs, True, 0, NO_MODES, grad), steps

    def _plan(self, batch: StepBatch) -> StepPlan[OutputT]:
        """Where ``batch`` loops: its loopable graph's captured loop, or the host (logged; strict raises)."""
        parts = self._parts
        largest = parts.dispatcher.config.capture_sizes.max
        if batch.num_tokens > largest:  # the host loop runs on the static buffers
            raise ValueError(
                f"run_loop: {batch.num_tokens} requests (input {parts.buffers.first('tokens')!r}): "
                f"a decode loop runs on the static buffers, of at most {largest} tokens (the largest "
                "capture size); split the batch"
            )
        plan = self._planner.plan(batch, loop=True)
        if plan.entry is not None:
            self._path.check_weights()  # WeightsReplacedError names it, before a buffer is touched
        if plan.loop is None and parts.strict:
            why = self._planner.why(plan, loop=True)
            raise NoGraphError(batch.num_tokens, f"run_loop would loop on the host: {why}")
        if plan.loop is None:
            self._planner.looping_on_host(plan)
        return plan

    def _count(self, plan: StepPlan[OutputT], taken: int, by_size: dict[int, int]) -> None:
        """``taken`` steps of ``plan``'s loop (``by_size``: on the device, by key)."""
        graph, num_tokens = plan.graph, plan.batch.num_tokens
        if plan.loop is None:
            padding = (graph.num_tokens - num_tokens) * taken if plan.padded and graph is not None else 0
        else:  # a shrinking loop pads only on its first key: the others hold fewer live rows
            padding = sum(steps * max(size - num_tokens, 0) for size, steps in by_size.items())
        counts = self._parts.counts
        counts.looped(taken, padding, host=plan.loop is None, eager=plan.reason, by_size=by_size)
        if plan.loop is None and plan.entry is not None and graph is not None:
            graph.replayed_steps(taken)  # each step of the host loop replayed the one-step graph

    def _start(self, plan: StepPlan[OutputT]) -> tuple[ForwardContext, tuple[int, int]]:
        """The loop's context (its metadata built first: it may refuse), the batch copied in, state reset.

        Returns the context and the rows the loop runs on: its graph's, else the batch's own.
        """
        batch, graph = plan.batch, plan.graph
        context = self._planner.context(plan)
        if plan.padded and graph is not None:
            rows = (graph.num_tokens, graph.num_reqs)
        else:
            rows = (batch.num_tokens, batch.num_reqs)
        with torch.no_grad():
            self._parts.buffers.copy_in(
                batch.inputs, batch.num_tokens, batch.num_reqs, *rows, batch.requires_grad
            )
            self._buffers.reset(batch.num_reqs)
        return context, rows

    def _host_loop(
        self, plan: StepPlan[OutputT], context: ForwardContext, rows: tuple[int, int], max_steps: int
    ) -> int:
        """The loop on the host: each step replayed (or run eagerly), advanced, its stop flag read back."""
        graph, entry = plan.graph, plan.entry
        inputs = graph.inputs if plan.padded and graph is not None else self._parts.buffers.views(*rows)
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


def loop_inputs(given: object, named: Mapping[str, object]) -> Mapping[str, torch.Tensor]:
    """``run_loop``'s inputs: the mapping ``given``, or the keywords ``named``; ``ValueError`` if one is bad.

    ``run``'s own keywords are refused by name: a loop's batch is always
    uniform, without adapters. The tensors themselves are the step's checks'.
    """
    reserved = sorted(RESERVED_NAMES.intersection(named))
    if reserved:
        raise ValueError(
            f"run_loop: {reserved[0]}: not an argument of run_loop (a decode loop's batch is always "
            f"uniform, one token per request, with no active adapters); got {named[reserved[0]]!r:.60}"
        )
    if given is None:
        return named  # type: ignore[return-value]  # the step's checks check each value
    if named:
        raise ValueError("run_loop: batch: pass the inputs as keywords or in one mapping, not both")
    if not isinstance(given, Mapping):
        raise ValueError(
            "run_loop: batch: expected a mapping of input names to tensors (or the inputs as keywords), "
            f"got {_shown(given)}"
        )
    for name in given:
        if not isinstance(name, str):
            raise ValueError(f"run_loop: batch: expected input names (strings) as keys, got {name!r:.60}")
    return given


def _shown(value: object) -> str:
    """``value`` for an error: a tensor by dtype and shape, anything else by type and a short repr."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r:.60}"
