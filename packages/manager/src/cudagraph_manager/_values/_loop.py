"""A decode loop's values: what ``run_loop`` takes (``DecodeLoop``), what ``advance`` sees, what it returns.

Many decode steps per call: the model's forward, then the user's
``advance``, repeated on the device (docs/design.md, "Decode loops"). The
loop's state at fixed addresses is ``_memory/_buffers.LoopBuffers``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Generic

import torch

from cudagraph_capture import LoopKind, LoopPolicy
from cudagraph_dispatch.lowlevel import check_bool, check_int

from ._inputs import signature_of
from ._protocols import OutputT

#: The default policy: WHILE where it can be built, else unrolled launches of 8 iterations.
_WHILE_WHERE_IT_CAN: Final = LoopPolicy()

#: The most steps one loop may be captured for (its token history is ``[max_steps, max_num_seqs]``).
MAX_LOOP_STEPS: Final = 1 << 16
#: A finished request's token at the steps after its last: what ``advance`` writes for a request
#: that is not active, and what a shrinking loop gives a request it stopped computing.
FINISHED: Final = -1


class ShrinkFallback(enum.Enum):
    """Why ``capture()``'s decode loops do not shrink (``CaptureReport.shrink_fallback`` starts with it)."""

    ONE_GRAPH = "one_graph"  # one loopable key of its class: nothing smaller to choose
    NO_ROW_ORDER = "no_row_order"  # the attention builder has no request_rows()
    NO_DEVICE_CHOICE = "no_device_choice"  # the loops are not WHILE here, or neither SWITCH nor IF built


@dataclasses.dataclass(frozen=True, slots=True)
class LoopState:
    """What ``advance`` gets each iteration: views of the manager's loop buffers (fixed addresses).

    ``step``: ``[]`` int64 on the device, this iteration's index (0 first).
    ``stop``: ``[]`` bool; set it in place once no request is active: the
    loop ends after this iteration. ``active``: ``[num_reqs]`` bool, True for
    the real requests still running (padding rows start False); clear a
    request's entry when it finishes (it is masked, not removed; never set
    one again). ``tokens``: ``[max_steps, num_reqs]`` int64; write this
    iteration's tokens at row ``step`` (with ``DecodeLoop(shrink=True)``,
    -1 for a request not active: a shrinking loop stops computing finished
    requests and gives them -1). ``num_reqs`` is the padded key's; under a
    shrinking loop, the rows are the live requests first (the loop moves
    them) and ``num_reqs`` the key it runs now.
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
    branch on a tensor's value, no random numbers. ``policy``: the kind of
    ``DeviceLoop`` (``cudagraph_capture.LoopPolicy``: WHILE where it can be
    built, checking stop every ``check_every`` steps, else unrolled launches).
    ``shrink``: each step runs on the smallest key of the batch's class that
    holds the requests still active (the loop moves them to the front on the
    device, a SWITCH node chooses the graph: docs/design.md,
    "Decode loops"). It asks two things of ``advance``: ``-1`` (``FINISHED``) as the
    token of a request not active (the loop gives that to the requests it
    no longer computes), and every per-request state it keeps in the static
    inputs, the attention builder's ``request_rows()`` or ``request_rows``.
    Off by default: an advance written for a loop that computes every row
    to the end keeps its tokens. ``request_rows``: the per-request tensors of
    the advance (or the model) outside those, ``[rows, ...]`` (dim 0 the
    request, at least ``max_num_seqs`` rows): a shrinking loop moves their
    rows with the requests'.
    """

    advance: Callable[[OutputT, Mapping[str, torch.Tensor], LoopState], object]
    max_steps: int
    policy: LoopPolicy = _WHILE_WHERE_IT_CAN
    request_rows: Sequence[torch.Tensor] = ()
    shrink: bool = False

    def __post_init__(self) -> None:
        _check_advance(self.advance)
        check_int("max_steps", self.max_steps, minimum=1, maximum=MAX_LOOP_STEPS)
        given: object = self.policy
        if not isinstance(given, LoopPolicy):
            raise ValueError(f"policy: expected a LoopPolicy, got {given!r:.80}")
        rows: object = self.request_rows
        if not isinstance(rows, Sequence) or not all(isinstance(t, torch.Tensor) for t in rows):
            raise ValueError(f"request_rows: expected a sequence of tensors, got {rows!r:.80}")
        object.__setattr__(self, "request_rows", tuple(rows))
        check_bool("shrink", self.shrink)


def _check_advance(advance: object) -> None:
    """``advance`` is a callable taking ``(outputs, inputs, state)`` by position, as each iteration calls it.

    Checked when the loop is built: a wrong arity would fail mid-step, after
    the batch was copied in. A callable without a signature (some builtins)
    is taken as it is.
    """
    if not callable(advance):
        raise ValueError(f"advance: expected a callable taking (outputs, inputs, state), got {advance!r:.80}")
    signature = signature_of(advance)
    if signature is None:  # no signature to read: its first call will say
        return
    try:
        signature.bind(None, None, None)
    except TypeError as error:
        raise ValueError(
            f"advance: expected a callable taking (outputs, inputs, state), got {advance!r:.80} "
            f"whose signature {_unannotated(signature)} does not: {error}"
        ) from None


def _unannotated(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` without its annotations: the names are what an arity error is about."""
    empty = inspect.Parameter.empty
    parameters = [p.replace(annotation=empty) for p in signature.parameters.values()]
    return signature.replace(parameters=parameters, return_annotation=empty)


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


def check_loop_steps(config: DecodeLoop[OutputT], max_steps: object) -> int:
    """``max_steps`` of a ``run_loop`` call: at most the config's, which is the default."""
    if max_steps is None:
        return config.max_steps
    return check_int("max_steps", max_steps, minimum=1, maximum=config.max_steps)
