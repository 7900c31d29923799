"""Many decode steps per call: the one-step forward and an advance, looped on the device (``run_loop``).

A uniform decode batch whose requests each take one token per step can run
many steps without the host: the model's forward, then the user's
``advance`` (sample, write the next step's inputs and the attention's
metadata in place, mark finished requests, set the stop flag), repeated by a
``cudagraph_capture.DeviceLoop`` (a WHILE node; unrolled or host fallbacks).
``capture()`` captures one loop per FULL key with a request row per token
(``loopable``), beside its one-step graph, into the same pool. ``run_loop`` takes
the loop where it is captured; else it loops on the host over the same
static buffers (the one-step graph replayed, or the model run eagerly),
reading the stop flag after each step: the same tokens, slower.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Final, Generic

import torch

from cudagraph_capture import CaptureError, CaptureOptions, DeviceLoop, GraphEntry, LoopKind
from cudagraph_dispatch import (
    FORWARD_CONTEXT_VAR,
    NO_MODES,
    BatchDescriptor,
    CUDAGraphMode,
    Dispatch,
    ForwardContext,
    check_int,
)

from .._attention._seam import BatchShape, StepBatch, metadata_extra
from .._capture._planned import PlannedKey
from .._memory._device import free_bytes, reserved_bytes
from .._memory._weights import WeightWatch
from .._parts import ManagerParts
from .._protocols import OutputT
from .._reports._report import CapturedGraph

_LOG: Final = logging.getLogger("cudagraph_manager")

#: The most steps one loop may be captured for (its token history is ``[max_steps, max_num_seqs]``).
MAX_LOOP_STEPS: Final = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True)
class LoopState:
    """What ``advance`` gets each iteration: views of the manager's loop buffers (fixed addresses).

    ``step``: ``[]`` int64 on the device, this iteration's index (0 first).
    ``stop``: ``[]`` bool; set it in place once no request is active: the
    loop ends after this iteration. ``active``: ``[num_reqs]`` bool, True for
    the real requests still running (padding rows start False); clear a
    request's entry when it finishes (it is masked, not removed).
    ``tokens``: ``[max_steps, num_reqs]`` int64; write this iteration's
    tokens at row ``step``. ``num_reqs`` is the padded key's.
    """

    step: torch.Tensor
    stop: torch.Tensor
    active: torch.Tensor
    tokens: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeLoop(Generic[OutputT]):
    """``ManagerOptions.decode_loop``: the advance of one decode step, and how many steps a call may loop.

    ``advance(outputs, inputs, state)``: from the step's outputs (the padded
    key's rows) write the next step's inputs in place into ``inputs`` (the
    static buffers, by name), the attention's metadata (read it with
    ``attention_metadata(builder)``: it runs under the step's forward
    context), ``state.tokens[state.step]``, ``state.active`` and
    ``state.stop``. Capturable: device ops only, no host synchronization, no
    branch on a tensor's value, no random numbers. ``unroll``: iterations
    per launch of the unrolled fallback; ``kind`` forces a ``LoopKind``
    (``None``: WHILE where it can be built).
    """

    advance: Callable[[OutputT, Mapping[str, torch.Tensor], LoopState], object]
    max_steps: int
    unroll: int = 8
    kind: LoopKind | None = None

    def __post_init__(self) -> None:
        if not callable(self.advance):
            raise ValueError(f"advance: expected a callable, got {self.advance!r:.80}")
        check_int("max_steps", self.max_steps, minimum=1, maximum=MAX_LOOP_STEPS)
        check_int("unroll", self.unroll, minimum=1, maximum=MAX_LOOP_STEPS)
        given: object = self.kind
        if given is not None and not isinstance(given, LoopKind):
            raise ValueError(f"kind: expected None or a LoopKind, got {given!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class LoopResult:
    """What ``run_loop`` did: each step's tokens of the real requests, and how many steps.

    ``tokens``: ``[steps, num_reqs]`` int64, a view of the manager's buffer,
    valid until its next ``run_loop``, ``capture()`` or ``estimate_memory()``
    (a loop's capture runs its body once). ``kind``: how the loop ran
    (``LoopKind``), or ``None`` where it looped on the host for want of a
    captured loop.
    """

    tokens: torch.Tensor
    steps: int
    kind: LoopKind | None


class DecodeLoops(Generic[OutputT]):
    """A manager's decode loops: state buffers, a ``DeviceLoop`` per uniform key, ``run_loop``'s paths."""

    __slots__ = ("_active", "_keys", "_parts", "_step", "_stop", "_tokens", "config", "loops")

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        config: DecodeLoop[OutputT],
        keys: Mapping[BatchDescriptor, PlannedKey[OutputT]],
    ) -> None:
        self._parts: Final = parts
        self._keys: Final = keys  # the manager's plan: a key's entry says whether it is captured
        self.config: Final = config
        device, max_reqs = parts.device, parts.dispatcher.config.max_num_seqs
        self._stop: Final = torch.zeros((), dtype=torch.bool, device=device)
        self._step: Final = torch.zeros((), dtype=torch.int64, device=device)  # the host loop's index
        self._active: Final = torch.zeros(max_reqs, dtype=torch.bool, device=device)
        self._tokens: Final = torch.zeros(config.max_steps, max_reqs, dtype=torch.int64, device=device)
        #: The captured loops by key; a key without one loops on the host.
        self.loops: Final[dict[BatchDescriptor, DeviceLoop]] = {}

    @staticmethod
    def loopable(key: PlannedKey[OutputT]) -> bool:
        """Whether ``key`` gets a loop: a FULL key with a request row per token.

        A uniform key of one token per request, or (mode FULL, which plans no
        uniform keys) an exact key of as many requests as tokens: a decode
        batch pads to it, one token per request in the real rows.
        """
        return key.mode is CUDAGraphMode.FULL and key.num_reqs == key.num_tokens

    def state(self, step: torch.Tensor, num_reqs: int) -> LoopState:
        return LoopState(step, self._stop, self._active[:num_reqs], self._tokens[:, :num_reqs])

    def capture(self, key: PlannedKey[OutputT], options: CaptureOptions) -> CapturedGraph:
        """Capture ``key``'s loop (the forward and the advance) into ``options``' pool; what it cost."""
        loop, captured = self.record(key, options)
        self.loops[key.descriptor] = loop
        return captured

    def capture_or_log(self, key: PlannedKey[OutputT], options: CaptureOptions) -> list[CapturedGraph]:
        """``capture``, or (a ``CaptureError``) a warning: the key's steps loop on the host meanwhile."""
        try:
            return [self.capture(key, options)]
        except CaptureError as error:
            _LOG.warning(
                "decode loop of %s not captured, its run_loop loops on the host: %s", key.descriptor, error
            )
            return []

    def record(self, key: PlannedKey[OutputT], options: CaptureOptions) -> tuple[DeviceLoop, CapturedGraph]:
        """``key``'s loop, not kept (the estimate's probes keep theirs apart), and what it cost."""
        start = time.perf_counter()
        device = self._parts.device
        self._parts.buffers.fill_padding(key.num_tokens, key.num_reqs)
        extra = self._metadata(StepBatch.padding(), key.shape)  # valid values for the body's warm-up
        self._active.fill_(False)  # the warm-up's rows are all padding
        self._stop.fill_(False)
        context = ForwardContext(CUDAGraphMode.FULL, key.descriptor, extra)

        def body(step: torch.Tensor) -> None:  # a context per call: an attention may key its plan on it
            self._iteration(key.inputs, ForwardContext(*context), self.state(step, key.num_reqs))

        reserved, free = reserved_bytes(device), free_bytes(device)
        config = self.config
        with torch.no_grad():
            loop = DeviceLoop.capture(
                body,
                stop=self._stop,
                max_steps=config.max_steps,
                unroll=config.unroll,
                kind=config.kind,
                options=options,
                descriptor=key.descriptor,
            )
        pool_bytes = reserved_bytes(device) - reserved
        seconds = time.perf_counter() - start
        driver = free - free_bytes(device) - pool_bytes
        return loop, CapturedGraph(CUDAGraphMode.FULL, key.descriptor, seconds, pool_bytes, driver, loop=True)

    def call(
        self,
        batch: Mapping[str, torch.Tensor] | None,
        named: Mapping[str, torch.Tensor],
        max_steps: int | None,
        weights: WeightWatch,
    ) -> LoopResult:
        """``run_loop``: checked inputs routed to their uniform key; ``run`` with it (or without one)."""
        if batch is not None and named:
            raise ValueError("batch: pass the inputs as keywords or in one mapping, not both")
        inputs = named if batch is None else batch
        steps = check_loop_steps(self.config, max_steps)
        counts = self._parts.buffers.check(inputs, True)
        if counts[0] == 0:  # an idle loop: no model call, no step
            return LoopResult(self._tokens[:0, :0], 0, None)
        route = self._parts.dispatcher.route(counts[0], True, 0, NO_MODES)
        key = self._keys[route.descriptor] if isinstance(route, Dispatch) else None
        largest = self._parts.dispatcher.config.capture_sizes.max
        if key is None and counts[0] > largest:  # the host loop runs on the static buffers
            raise ValueError(
                f"num_tokens: a decode loop runs on the static buffers, of at most {largest} tokens "
                f"(the largest capture size); got {counts[0]} requests"
            )
        entry = None if key is None else key.entry  # read once: a background capture may store it
        if entry is not None and weights.moved():
            weights.check()  # WeightsReplacedError names it, before a buffer is touched
        return self.run(key if key is None or self.loopable(key) else None, entry, inputs, counts, steps)

    def run(
        self,
        key: PlannedKey[OutputT] | None,
        entry: GraphEntry[OutputT] | None,
        inputs: Mapping[str, torch.Tensor],
        counts: tuple[int, int, bool],
        max_steps: int,
    ) -> LoopResult:
        """One ``run_loop``: the batch copied in (padded to ``key``), the state reset, the loop run.

        ``key``: the key the batch pads to (``None``: none, the host loops
        over the unpadded batch); ``entry``: its one-step graph as read once
        (``None``: not captured). Its loop runs where it was captured; else
        the one-step graph is replayed per step, or without one the model
        runs eagerly on the padded buffers.
        """
        if key is None:
            entry = None
        num_tokens, num_reqs, requires_grad = counts
        if key is None:
            rows, shape = (num_tokens, num_reqs), BatchShape.eager(num_tokens, num_reqs, True)
            descriptor = BatchDescriptor(num_tokens, num_reqs, True)
        else:
            rows, descriptor = (key.num_tokens, key.num_reqs), key.descriptor
            shape = key.shape if entry is not None else key.eager_shape
        extra = self._metadata(StepBatch(num_tokens, num_reqs, inputs), shape)  # first: it may refuse
        with torch.no_grad():
            self._parts.buffers.copy_in(inputs, num_tokens, num_reqs, *rows, requires_grad)
            self._active[:num_reqs].fill_(True)
            self._active[num_reqs : rows[1]].fill_(False)
            self._stop.fill_(False)
        loop = None if key is None or entry is None else self.loops.get(key.descriptor)
        if loop is not None:
            loop.launch(max_steps)
            steps = int(loop.steps_taken)  # the one synchronization
        else:
            context = ForwardContext(shape.mode, descriptor, extra)
            steps = self._host_loop(key, entry, context, rows, max_steps)
        return LoopResult(self._tokens[:steps, :num_reqs], steps, None if loop is None else loop.kind)

    def _host_loop(
        self,
        key: PlannedKey[OutputT] | None,
        entry: GraphEntry[OutputT] | None,
        context: ForwardContext,
        rows: tuple[int, int],
        max_steps: int,
    ) -> int:
        """The loop on the host: each step replayed (or run eagerly), advanced, its stop flag read back."""
        inputs = self._parts.buffers.views(*rows) if key is None else key.inputs
        state = self.state(self._step, rows[1])
        with torch.no_grad():
            for step in range(max_steps):
                self._step.fill_(step)
                if entry is not None:
                    entry.replay()
                self._iteration(
                    inputs, ForwardContext(*context), state, None if entry is None else entry.output
                )
                if bool(self._stop):  # the read-back a host loop pays every step
                    return step + 1
        return max_steps

    def _iteration(
        self,
        inputs: Mapping[str, torch.Tensor],
        context: ForwardContext,
        state: LoopState,
        output: OutputT | None = None,
    ) -> None:
        """The forward on ``inputs`` (unless a replay gave ``output``), then the advance, in ``context``."""
        token = FORWARD_CONTEXT_VAR.set(context)
        try:
            out = self._parts.model(**inputs) if output is None else output
            self.config.advance(out, inputs, state)
        finally:
            FORWARD_CONTEXT_VAR.reset(token)

    def _metadata(self, batch: StepBatch, shape: BatchShape) -> Mapping[str, object]:
        """The context's extras: the attention's metadata of ``batch`` as ``shape`` (or none)."""
        builder = self._parts.builder
        return {} if builder is None else metadata_extra(builder, builder.build(batch, shape))

    def drop_all(self) -> None:
        """Free every loop (their keys loop on the host until the next ``capture()``)."""
        self.loops.clear()


def check_loop_steps(config: DecodeLoop[OutputT], max_steps: object) -> int:
    """``max_steps`` of a ``run_loop`` call: at most the config's, which is the default."""
    if max_steps is None:
        return config.max_steps
    return check_int("max_steps", max_steps, minimum=1, maximum=config.max_steps)
