"""The attention seam: per-step metadata built for the padded batch, handed to the model.

An attention backend's metadata (cumulative query offsets, sequence lengths,
block tables, a query-length bound, a split plan) depends on the batch, and a
FULL graph reads it at fixed addresses with its host values baked in. The
manager therefore asks the backend's ``AttentionMetadataBuilder`` for it on
every path, always with the batch the forward runs as (``BatchShape``: the
padded key's counts for a graph, the real counts for an eager step):

- before a key's warm-up: ``build`` of an all-padding batch (``StepBatch`` of
  0 tokens), so the warm-up reads valid values;
- before a key's recording: ``build_for_capture`` (host work only: a
  recording runs nothing on the device, and a serving step may be in flight);
- every step: ``build`` of the real batch, on the step's stream, before the
  replay (FULL, PIECEWISE) or the eager call.

The model reads the result with ``attention_metadata(builder)`` inside its
forward: the value travels in the forward context, typed by the builder.
``pad_offsets`` pads cumulative offsets as graphs need them: every padding
request ends at the padded total.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, NamedTuple, TypeVar, cast

import torch

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, get_forward_context

if TYPE_CHECKING:
    from .._protocols import AttentionMetadataBuilder

M = TypeVar("M")

#: The forward context's extra that carries the step's metadata (``attention_metadata`` reads it).
METADATA_EXTRA: Final = "attention_metadata"


@dataclasses.dataclass(frozen=True, slots=True)
class BatchShape:
    """The batch a forward runs as, as its attention sees it: counts, layout and runtime mode.

    For a graph: the padded key's ``num_tokens`` and ``num_reqs`` (a relaxed
    PIECEWISE key has ``min(num_tokens, max_num_seqs)`` request rows), and
    ``mode`` FULL or PIECEWISE. For an eager step: the real counts, and NONE.
    ``query_len``: every request has this many tokens (a uniform key or a
    uniform eager batch); ``None`` for a mixed batch. A FULL graph bakes
    the host values its metadata holds: they may depend on the shape only.
    """

    num_tokens: int
    num_reqs: int
    query_len: int | None
    mode: CUDAGraphMode

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
    """The real batch of a step: its counts and the inputs given to ``run`` (checked, not padded).

    ``num_tokens`` (and ``num_reqs``) are at most the shape's; the rows from
    there up to the shape's are padding. A warm-up builds for
    ``StepBatch.padding()``: 0 tokens, no inputs, every row padding.
    """

    num_tokens: int
    num_reqs: int
    inputs: Mapping[str, torch.Tensor]

    @classmethod
    def padding(cls) -> StepBatch:
        return _PADDING


_PADDING: Final = StepBatch(0, 0, MappingProxyType({}))


class _Built(NamedTuple):
    """What the forward context carries: the builder, and the metadata it built for this forward."""

    builder: object
    metadata: object


def metadata_extra(builder: object, metadata: object) -> dict[str, object]:
    """The forward-context extras that carry ``metadata`` built by ``builder``."""
    return {METADATA_EXTRA: _Built(builder, metadata)}


def attention_metadata(builder: AttentionMetadataBuilder[M]) -> M:
    """The metadata ``builder`` built for the forward running now (inside the model's forward).

    The manager sets it on every path: captures, warm-ups, replays of
    PIECEWISE graphs (their eager attention reads it), eager steps. Outside
    such a forward, or for another builder, ``RuntimeError`` says so.
    """
    context = get_forward_context()
    built = None if context is None else context.extra.get(METADATA_EXTRA)
    if not isinstance(built, _Built):
        raise RuntimeError(
            "attention_metadata: no attention metadata in the forward context; call it inside a forward "
            "run by a CUDAGraphManager built with AttentionOptions(metadata_builder=...) (or under "
            "set_forward_context(..., **metadata_extra(builder, metadata)))"
        )
    if built.builder is not builder:
        raise RuntimeError(
            f"attention_metadata: the forward's metadata was built by {built.builder!r:.80}, "
            f"not by {builder!r:.80}"
        )
    # The one cast of the seam: the builder that returned this value is the one asked for.
    return cast(M, built.metadata)


def pad_offsets(out: torch.Tensor, offsets: torch.Tensor, padded_total: int) -> torch.Tensor:
    """Cumulative offsets of a padded batch into ``out``; returns ``out``.

    ``offsets [n + 1]`` are the real batch's (``offsets[0] == 0``, the last
    the real total); ``out [padded_reqs + 1]`` (``padded_reqs >= n``) gets
    them, then ``padded_total`` in every row after: the first padding
    request holds every padding token, the others none, and the last offset
    is the padded total, as a kernel over the padded batch reads it.
    Device ops on the current stream, no host synchronization.
    """
    real = offsets.shape[0]
    if real < 1 or real > out.shape[0]:
        raise ValueError(
            f"offsets: expected between 1 and {out.shape[0]} rows (the padded batch's requests + 1), "
            f"got {real}"
        )
    out[:real].copy_(offsets)
    out[real:].fill_(padded_total)
    return out


def pad_rows(out: torch.Tensor, rows: torch.Tensor, pad_value: int | float) -> torch.Tensor:
    """``rows`` into the first rows of ``out``, ``pad_value`` in the rest; returns ``out``."""
    real = rows.shape[0]
    if real > out.shape[0]:
        raise ValueError(f"rows: {real} rows do not fit the {out.shape[0]} of the padded batch")
    out[:real].copy_(rows)
    out[real:].fill_(pad_value)
    return out
