"""The attention seam's helpers: the metadata in the forward context, and padded offsets and rows.

The manager builds the attention's metadata for the batch a forward runs as
(docs/design.md, "The attention seam") and hands it to the model in the
forward context (``metadata_extra``); the model reads it back with
``attention_metadata(builder)``, typed by the builder. ``pad_offsets`` and
``pad_rows`` pad a builder's per-request tensors as graphs read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple, TypeVar, cast

import torch

from cudagraph_dispatch import get_forward_context

if TYPE_CHECKING:
    from .._protocols import AttentionMetadataBuilder

M = TypeVar("M")

#: The forward context's extra that carries the step's metadata (``attention_metadata`` reads it).
METADATA_EXTRA: Final = "attention_metadata"


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
