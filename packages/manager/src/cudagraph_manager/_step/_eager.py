"""Steps without a graph: counted per reason, logged once per reason, refused in strict mode.

The manager decides why a step replays nothing (``EagerReason``); this module
runs it: the model on the batch as it is, or, on a device without CUDA graphs,
the step the graph would replay, run eagerly on the padded static buffers and
cut like a replay's outputs. Idle steps (0 tokens) and an idle rank's part in
the others' eager step are here too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final, Generic, cast

import torch

from cudagraph_dispatch import (
    BatchDescriptor,
    CUDAGraphMode,
    EagerReason,
    Route,
    StepRequest,
    set_forward_context,
)

from .._attention._seam import BatchShape, StepBatch, metadata_extra
from .._capture._planned import PlannedKey
from .._errors import NoGraphError
from .._parts import ManagerParts
from .._protocols import CaptureState, OutputT

_logger: Final = logging.getLogger("cudagraph_manager")
_NONE: Final = CUDAGraphMode.NONE


class EagerSteps(Generic[OutputT]):
    """Runs the model for the steps that replay no graph, and counts them."""

    __slots__ = ("_logged", "_parts")

    def __init__(self, parts: ManagerParts[OutputT]) -> None:
        self._parts: Final = parts
        self._logged: Final[set[EagerReason]] = set()

    def run(
        self,
        inputs: Mapping[str, torch.Tensor],
        request: StepRequest,
        num_reqs: int,
        reason: EagerReason,
        key: PlannedKey[OutputT] | None,
        *,
        allowed: bool = False,
    ) -> OutputT:
        """The model run eagerly for ``reason`` (``key``: the planned key the step would replay).

        ``allowed``: a step strict mode lets through (its key is captured by a
        running background capture). Strict raises ``NoGraphError`` otherwise.
        """
        parts = self._parts
        num_tokens = request.num_tokens
        if parts.strict and not allowed:
            raise NoGraphError(num_tokens, self._why(reason, key, request))
        if reason not in self._logged:  # once per reason: visible, never a flood
            self._logged.add(reason)
            level = logging.INFO if reason is EagerReason.NO_CUDA else logging.WARNING
            why = self._why(reason, key, request)
            _logger.log(level, "running a step of %d tokens eagerly (%s): %s", num_tokens, reason.value, why)
        parts.counts.eager[reason] = parts.counts.eager.get(reason, 0) + 1
        if reason is EagerReason.NO_CUDA and key is not None:
            return self._padded(inputs, num_tokens, num_reqs, key)
        # The batch as it is: an attention may lay out a uniform batch per request.
        uniform = request.uniform_decode and num_reqs > 0
        descriptor = BatchDescriptor(num_tokens, num_reqs, True) if uniform else BatchDescriptor(num_tokens)
        batch = StepBatch(num_tokens, num_reqs, inputs)
        with (
            torch.no_grad(),
            self._context(descriptor, batch, BatchShape.eager(num_tokens, num_reqs, uniform)),
        ):
            out = parts.model(**inputs)
        # The outputs of an eager step are checked as a capture's are (rows, structure):
        # a wrong output never reaches the caller silently. Eager steps only.
        parts.layout.of(out).check(out, num_tokens, num_reqs)
        return out

    def without_graph(
        self,
        inputs: Mapping[str, torch.Tensor],
        request: StepRequest,
        num_reqs: int,
        route: Route,
        key: PlannedKey[OutputT] | None,
        dummy: bool,
        captures: CaptureState,
    ) -> OutputT:
        """A step that replays nothing: an idle rank's part, or an eager step for the reason decided here.

        A route without a graph is its own reason; a planned key without a
        graph is ``not_captured``, or ``no_cuda`` where nothing can be
        captured, or ``released`` (``captures``); a key missed while a
        background capture runs is reported to it (captured next) and
        allowed in strict mode. ``dummy``: an idle rank runs a dummy step
        along with the others' eager step.
        """
        if request.num_tokens == 0:  # an idle rank: an idle step without ranks never routes
            return self.dummy_step() if dummy else self.idle(inputs)
        reason = route if isinstance(route, EagerReason) else EagerReason.NOT_CAPTURED
        if reason is EagerReason.NOT_CAPTURED:
            if self._parts.no_graphs is not None:  # the ranks' route says "not captured" for it too
                reason = EagerReason.NO_CUDA
            elif captures.released:
                reason = EagerReason.RELEASED
            elif key is not None and (session := captures.running()) is not None:
                session.missed(key.descriptor)  # captured next; the first recording waits for served()
                try:
                    return self.run(inputs, request, num_reqs, reason, key, allowed=True)
                finally:
                    session.served()
        return self.run(inputs, request, num_reqs, reason, key)

    def idle(self, inputs: Mapping[str, torch.Tensor]) -> OutputT:
        """A step of 0 tokens: the outputs' structure with no rows, without calling the model.

        Only a manager that has seen no outputs yet (no capture, no step) calls
        the model once, on the empty inputs, to learn their structure.
        """
        parts = self._parts
        parts.counts.idle_steps += 1
        layout = parts.layout.layout
        if layout is None:
            batch = StepBatch(0, 0, inputs)
            with torch.no_grad(), self._context(BatchDescriptor(0), batch, BatchShape.eager(0, 0, False)):
                out = parts.model(**inputs)
            parts.layout.of(out).check(out, 0, 0)
            return out
        return cast(OutputT, layout.empty())

    def dummy_step(self) -> OutputT:
        """An idle rank's part in an eager step of the others: the model once on one padding row.

        Outputs with 0 rows; counted in ``stats.dummy_steps``; strict raises.
        """
        parts = self._parts
        if parts.strict:
            raise NoGraphError(0, f"the other ranks of the {parts.world_size} run this step eagerly")
        parts.counts.dummy_steps += 1
        parts.buffers.fill_padding(1, 1)
        padding = StepBatch.padding()
        with torch.no_grad(), self._context(BatchDescriptor(1), padding, BatchShape.eager(1, 1, False)):
            out = parts.model(**parts.buffers.views(1, 1))
        layout = parts.layout.of(out)
        layout.check(out, 1, 1)
        return cast(OutputT, layout.cut(out, 0, 0))

    def _padded(
        self, inputs: Mapping[str, torch.Tensor], num_tokens: int, num_reqs: int, key: PlannedKey[OutputT]
    ) -> OutputT:
        """No CUDA graphs here: the step ``key``'s graph would replay, run on the padded static buffers."""
        parts = self._parts
        batch = StepBatch(num_tokens, num_reqs, inputs)
        with (
            torch.no_grad(),
            self._context(key.descriptor, batch, key.eager_shape),
        ):  # no_grad: the copies too
            parts.buffers.copy_in(inputs, num_tokens, num_reqs, key.num_tokens, key.num_reqs)
            padded = parts.model(**key.inputs)
        layout = parts.layout.of(padded)
        layout.check(padded, key.num_tokens, key.num_reqs)
        parts.counts.padded_tokens += key.num_tokens - num_tokens
        return cast(OutputT, layout.cut(padded, num_tokens, num_reqs))

    def _context(
        self, descriptor: BatchDescriptor, batch: StepBatch, shape: BatchShape
    ) -> set_forward_context:
        """The eager forward's context: NONE, its key, the attention's metadata of ``batch`` as ``shape``."""
        builder = self._parts.builder
        if builder is None:
            return set_forward_context(_NONE, descriptor)
        return set_forward_context(_NONE, descriptor, **metadata_extra(builder, builder.build(batch, shape)))

    def _why(self, reason: EagerReason, key: PlannedKey[OutputT] | None, request: StepRequest) -> str:
        """A step's eager reason in words (for logs and errors)."""
        parts = self._parts
        if reason is EagerReason.NO_CUDA:
            return parts.no_graphs or "no CUDA graphs on this device"
        if reason is EagerReason.NOT_CAPTURED and key is not None:
            return f"its {key.mode.name} graph {key.descriptor} was not captured yet; call capture() first"
        if reason is EagerReason.RELEASED:
            return "its graphs were released (release()); start_capture() or capture() brings them back"
        if reason is EagerReason.OTHER_RANK and parts.world_size is not None:
            return f"another rank of the {parts.world_size} runs this step without a graph, so all do"
        return parts.dispatcher.explain(
            request.num_tokens,
            uniform_decode=request.uniform_decode,
            num_active_loras=request.num_active_loras,
            invalid_modes=request.invalid_modes,
        )
