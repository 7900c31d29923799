"""A step's batch as one value (``StepBatch``), and the shape a forward runs it as (``BatchShape``).

``StepBatch`` is built at most once per step, where the step leaves the
replay's fast path (an eager step, the attention's ``build``, a decode loop),
and passed along from there; the replay itself keeps the counts in locals
(host time per step). ``BatchShape`` is what the attention
sees of the batch a forward runs as: a graph's padded key, or the real batch
run eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, NamedTuple

import torch

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from cudagraph_dispatch._request import NO_MODES
from cudagraph_dispatch.lowlevel import check_int


@dataclasses.dataclass(frozen=True, slots=True)
class BatchShape:
    """The batch a forward runs as, as its attention sees it: counts, layout and runtime mode.

    For a graph: the padded key's ``num_tokens`` and ``num_reqs`` (a relaxed
    PIECEWISE key has ``min(num_tokens, max_num_seqs)`` request rows), and
    ``mode`` FULL or PIECEWISE. For an eager step: the real counts, and NONE.
    ``query_len``: every request has this many tokens (a uniform key or a
    uniform eager batch); ``None`` for a mixed batch. A FULL graph bakes
    the host values its metadata holds: they may depend on the shape only.
    Its fields are checked when it is built (``ValueError`` naming the
    field): the manager builds a graph's shape once, an eager step's per step.
    """

    num_tokens: int
    num_reqs: int
    query_len: int | None
    mode: CUDAGraphMode

    def __post_init__(self) -> None:
        num_tokens = check_int("num_tokens", self.num_tokens, minimum=0)
        num_reqs = check_int("num_reqs", self.num_reqs, minimum=0, maximum=num_tokens)
        mode: object = self.mode
        if not isinstance(mode, CUDAGraphMode) or not mode.is_runtime_mode():
            raise ValueError(
                f"mode: expected a runtime CUDAGraphMode (NONE, PIECEWISE or FULL), got {mode!r}"
            )
        if self.query_len is not None:
            query_len = check_int("query_len", self.query_len, minimum=1)
            if query_len * num_reqs != num_tokens:
                raise ValueError(
                    f"query_len: {num_reqs} requests of {query_len} tokens are not the shape's "
                    f"{num_tokens} tokens"
                )

    @property
    def uniform(self) -> bool:
        return self.query_len is not None

    @classmethod
    def of_key(cls, mode: CUDAGraphMode, key: BatchDescriptor, num_reqs: int) -> BatchShape:
        """The shape of ``key``'s graph in ``mode``, with ``num_reqs`` request rows."""
        query_len = key.num_tokens // num_reqs if key.uniform and num_reqs else None
        return cls(key.num_tokens, num_reqs, query_len, mode)

    @classmethod
    def eager(cls, num_tokens: int, num_reqs: int, uniform: bool) -> BatchShape:
        """The shape of an eager step of the real batch (uniform: ``num_tokens // num_reqs`` each)."""
        query_len = num_tokens // num_reqs if uniform and num_reqs else None
        return cls(num_tokens, num_reqs, query_len, CUDAGraphMode.NONE)


class StepBatch(NamedTuple):
    """The real batch of one step: its counts, its checked inputs (not padded) and how it was asked for.

    ``num_tokens`` and ``num_reqs`` are at most the shape's a forward runs it
    as; the rows from there up are padding. ``uniform_decode``,
    ``num_active_loras`` and ``invalid_modes`` are ``run()``'s arguments;
    ``requires_grad``: some input requires grad. A warm-up builds for
    ``StepBatch.padding()``: 0 tokens, no inputs, every row padding.

    Unchecked on purpose: a ``NamedTuple`` the manager builds per step (with
    a builder, per replay) from inputs it has checked. Code that takes one
    from a caller checks it there (``PackedMetadataBuilder.build``, the
    paged example's backends).
    """

    num_tokens: int
    num_reqs: int
    inputs: Mapping[str, torch.Tensor]
    uniform_decode: bool = False
    num_active_loras: int = 0
    invalid_modes: frozenset[CUDAGraphMode] = NO_MODES
    requires_grad: bool = False

    @classmethod
    def padding(cls) -> StepBatch:
        return _PADDING

    @property
    def uniform(self) -> bool:
        """Whether the batch runs eagerly as uniform: a uniform decode batch with requests."""
        return self.uniform_decode and self.num_reqs > 0

    def eager_descriptor(self) -> BatchDescriptor:
        """The key an eager forward of this batch runs under (its forward context's descriptor)."""
        if self.uniform:
            return BatchDescriptor(self.num_tokens, self.num_reqs, True)
        return BatchDescriptor(self.num_tokens)

    def eager_shape(self) -> BatchShape:
        """The shape the attention sees for this batch run eagerly, unpadded."""
        return BatchShape.eager(self.num_tokens, self.num_reqs, self.uniform)


_PADDING: Final = StepBatch(0, 0, MappingProxyType({}))
