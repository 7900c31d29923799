"""Steps without a graph: counted per reason, logged once per reason, refused in strict mode.

A step runs eagerly when the dispatcher found no graph for it (the reason
comes with its decision), when its graph is not captured yet, when another
rank has no graph, or on a device without CUDA graphs (then the step the
graph would replay runs eagerly on the padded static buffers, cut like a
replay's outputs). Idle steps (0 tokens) and an idle rank's part in the
others' eager step are here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Final, Generic, cast

import torch

from cudagraph_dispatch import (
    BatchDescriptor,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    EagerReason,
    Route,
    set_forward_context,
)

from ._background import BackgroundCapture
from ._buffers import StaticBuffers
from ._errors import NoGraphError
from ._outputs import LayoutCell
from ._planned import PlannedKey
from ._protocols import OutputT
from ._report import StepCounts
from .ranks import RankAgreement

#: A step's dispatch arguments: num_tokens, uniform_decode, num_active_loras, invalid_modes.
Request = tuple[int, bool, int, frozenset[CUDAGraphMode]]

_logger: Final = logging.getLogger("cudagraph_manager")
_NONE: Final = CUDAGraphMode.NONE


class EagerSteps(Generic[OutputT]):
    """Runs the model for the steps that replay no graph, and counts them."""

    __slots__ = (
        "_buffers",
        "_counts",
        "_dispatcher",
        "_layout",
        "_logged",
        "_model",
        "_no_graphs",
        "_ranks",
        "_strict",
        "released",
    )

    def __init__(
        self,
        model: Callable[..., OutputT],
        buffers: StaticBuffers,
        layout: LayoutCell,
        counts: StepCounts,
        strict: bool,
        dispatcher: CUDAGraphDispatcher,
        no_graphs: str | None,
        ranks: RankAgreement | None,
    ) -> None:
        self._model: Final = model
        self._buffers: Final = buffers
        self._layout: Final = layout
        self._counts: Final = counts
        self._strict: Final = strict
        self._dispatcher: Final = dispatcher
        self._no_graphs: Final = no_graphs  # why the manager captures nothing, or None
        self._ranks: Final = ranks
        self._logged: set[EagerReason] = set()
        #: The manager released its graphs (``release()``) and captured none since.
        self.released = False

    def run(
        self,
        inputs: Mapping[str, torch.Tensor],
        num_reqs: int,
        route: Route,
        key: PlannedKey[OutputT] | None,
        request: Request,
        session: BackgroundCapture | None,
    ) -> OutputT:
        """A step whose route has no replayable graph: the model run eagerly, for its reason.

        The reason is the route's (the dispatcher's), or, for a planned key
        without a graph, ``no_cuda`` or ``not_captured``; a key missed while a
        background capture runs is reported to it (captured next) and allowed
        in strict mode. Strict raises ``NoGraphError`` otherwise.
        """
        num_tokens = request[0]
        allowed = False
        if key is not None:
            reason = EagerReason.NO_CUDA if self._no_graphs is not None else EagerReason.NOT_CAPTURED
        else:
            assert isinstance(route, EagerReason)  # a Dispatch comes with its key
            # The ranks' route says "not captured" where this manager can capture nothing.
            no_cuda = route is EagerReason.NOT_CAPTURED and self._no_graphs is not None
            reason = EagerReason.NO_CUDA if no_cuda else route
        if reason is EagerReason.NOT_CAPTURED:
            if self.released:
                reason = EagerReason.RELEASED
            elif key is not None and session is not None and not session.done:
                session.missed(key.descriptor)
                allowed = True
        if self._strict and not allowed:
            raise NoGraphError(num_tokens, self._why(reason, key, request))
        if reason not in self._logged:  # once per reason: visible, never a flood
            self._logged.add(reason)
            level = logging.INFO if reason is EagerReason.NO_CUDA else logging.WARNING
            why = self._why(reason, key, request)
            _logger.log(level, "running a step of %d tokens eagerly (%s): %s", num_tokens, reason.value, why)
        counts = self._counts
        counts.eager[reason] = counts.eager.get(reason, 0) + 1
        with torch.no_grad():
            if reason is not EagerReason.NO_CUDA or key is None:
                # The batch as it is: an attention may lay out a uniform batch per request.
                uniform = request[1] and num_reqs > 0
                descriptor = (
                    BatchDescriptor(num_tokens, num_reqs, True) if uniform else BatchDescriptor(num_tokens)
                )
                with set_forward_context(_NONE, descriptor):
                    out = self._model(**inputs)
                # The outputs of an eager step are checked as a capture's are (rows, structure):
                # a wrong output never reaches the caller silently. Eager steps only.
                self._layout.of(out).check(out, num_tokens, num_reqs)
                return out
            # No CUDA graphs here: the step the graph would replay, run eagerly
            # on the padded static buffers, then cut like a replay's outputs.
            self._buffers.copy_in(inputs, num_tokens, num_reqs, key.num_tokens, key.num_reqs)
            with set_forward_context(_NONE, key.descriptor):
                padded = self._model(**key.inputs)
        layout = self._layout.of(padded)
        layout.check(padded, key.num_tokens, key.num_reqs)
        counts.padded_tokens += key.num_tokens - num_tokens
        return cast(OutputT, layout.cut(padded, num_tokens, num_reqs))

    def idle(self, inputs: Mapping[str, torch.Tensor]) -> OutputT:
        """A step of 0 tokens: the outputs' structure with no rows, without calling the model.

        Only a manager that has seen no outputs yet (no capture, no step) calls
        the model once, on the empty inputs, to learn their structure.
        """
        self._counts.idle_steps += 1
        layout = self._layout.layout
        if layout is None:
            with torch.no_grad(), set_forward_context(_NONE, BatchDescriptor(0)):
                out = self._model(**inputs)
            self._layout.of(out).check(out, 0, 0)
            return out
        return cast(OutputT, layout.empty())

    def pad_along(self, why: str) -> OutputT:
        """An idle rank's part in an eager step of the others: the model once on one padding row.

        Outputs with 0 rows; counted in ``stats.dummy_steps``; strict raises.
        """
        if self._strict:
            raise NoGraphError(0, why)
        self._counts.dummy_steps += 1
        self._buffers.fill_padding(1, 1)
        with torch.no_grad(), set_forward_context(_NONE, BatchDescriptor(1)):
            out = self._model(**self._buffers.views(1, 1))
        layout = self._layout.of(out)
        layout.check(out, 1, 1)
        return cast(OutputT, layout.cut(out, 0, 0))

    def _why(self, reason: EagerReason, key: PlannedKey[OutputT] | None, request: Request) -> str:
        """A step's eager reason in words (for logs and errors)."""
        if reason is EagerReason.NO_CUDA:
            return self._no_graphs or "no CUDA graphs on this device"
        if reason is EagerReason.NOT_CAPTURED and key is not None:
            return f"its {key.mode.name} graph {key.descriptor} was not captured yet; call capture() first"
        if reason is EagerReason.RELEASED:
            return "its graphs were released (release()); start_capture() or capture() brings them back"
        if reason is EagerReason.OTHER_RANK and self._ranks is not None:
            return f"another rank of the {self._ranks.world_size} runs this step without a graph, so all do"
        num_tokens, uniform_decode, num_active_loras, invalid_modes = request
        return self._dispatcher.explain(
            num_tokens,
            uniform_decode=uniform_decode,
            num_active_loras=num_active_loras,
            invalid_modes=invalid_modes,
        )
