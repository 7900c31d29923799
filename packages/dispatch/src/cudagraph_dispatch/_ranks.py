"""Agreement across data-parallel ranks: one decision that every rank runs.

Ranks of a data-parallel group step together (their MoE all-to-alls must
match), so they must replay graphs of one size, or all run eagerly. This is
a pure function of every rank's request: each rank gathers the requests
(with its engine's own collective) and computes the same answer locally.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._descriptor import BatchDescriptor
from ._modes import CUDAGraphMode
from ._protocols import GraphDispatcher
from ._request import NO_MODES, RankRequest
from ._rule import Dispatch


def agree_across_ranks(
    dispatcher: GraphDispatcher,
    requests: Sequence[RankRequest],
    *,
    invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
) -> Dispatch:
    """The decision every rank runs this step, from every rank's ``RankRequest``.

    Ranks with 0 tokens follow the others (all at 0: NONE). If any rank with
    tokens would run eagerly, all run eagerly, unpadded (the descriptor then
    carries the largest count). Otherwise all pad to the dispatch of the
    largest request, uniform only if every rank with tokens is uniform. A
    mode in ``invalid_modes`` or in any rank's request is off on every rank.

    Args:
        dispatcher: the dispatcher every rank built from one config (or any
            object with its ``dispatch``: a test's stand-in).
        requests: one ``RankRequest`` per rank, in rank order.
        invalid_modes: graph modes turned off on every rank this step.

    Returns:
        The ``Dispatch`` every rank runs: a graph's, or NONE with the largest
        count.

    Raises:
        ValueError: a bad argument, naming it; a request the dispatcher
            refuses (a uniform decode count that is not a multiple of
            ``uniform_decode_query_len``), naming its rank.
    """
    _check_agreement_arguments(dispatcher, requests, invalid_modes)
    for request in requests:
        invalid_modes = invalid_modes | request.invalid_modes
    active = [r for r in requests if r.num_tokens > 0]
    if not active:
        return Dispatch(CUDAGraphMode.NONE, BatchDescriptor(0))
    largest = max(r.num_tokens for r in active)
    eager = Dispatch(CUDAGraphMode.NONE, BatchDescriptor(largest))
    if CUDAGraphMode.NONE in _own_modes(dispatcher, requests, invalid_modes):
        return eager
    joint = dispatcher.dispatch(
        largest,
        uniform_decode=all(r.uniform_decode for r in active),
        num_active_loras=max(r.num_active_loras for r in active),
        invalid_modes=invalid_modes,
    )
    return eager if joint.mode is CUDAGraphMode.NONE else joint


def _check_agreement_arguments(dispatcher: object, requests: object, invalid_modes: object) -> None:
    """``ValueError`` naming the first bad argument of ``agree_across_ranks`` (callers may not be typed)."""
    if not callable(getattr(dispatcher, "dispatch", None)):
        raise ValueError(
            f"dispatcher: expected a CUDAGraphDispatcher (one with dispatch()), got {dispatcher!r:.80}"
        )
    if not isinstance(requests, Sequence):
        raise ValueError(f"requests: expected a sequence of RankRequest, one per rank, got {requests!r}")
    if not requests:
        raise ValueError(f"requests: expected one RankRequest per rank, got {requests!r}")
    for rank, request in enumerate(requests):
        if not isinstance(request, RankRequest):
            raise ValueError(f"requests[{rank}]: expected a RankRequest, got {request!r}")
    if not isinstance(invalid_modes, frozenset):
        raise ValueError(f"invalid_modes: expected a frozenset of PIECEWISE and FULL, got {invalid_modes!r}")


def _own_modes(
    dispatcher: GraphDispatcher, requests: Sequence[RankRequest], invalid_modes: frozenset[CUDAGraphMode]
) -> list[CUDAGraphMode]:
    """Every rank's own decision's mode, so that every request is checked before any answer."""
    modes = []
    for rank, r in enumerate(requests):
        if r.num_tokens:
            try:
                own = dispatcher.dispatch(
                    r.num_tokens,
                    uniform_decode=r.uniform_decode,
                    num_active_loras=r.num_active_loras,
                    invalid_modes=invalid_modes,
                )
            except ValueError as error:  # refused by the config: a uniform count not a multiple of q
                raise ValueError(f"requests[{rank}].{error}") from None
            modes.append(own.mode)
    return modes
