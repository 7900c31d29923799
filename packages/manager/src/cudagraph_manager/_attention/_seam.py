"""The attention seam's helpers: the metadata in the forward context, and padded offsets and rows.

The manager builds the attention's metadata for the batch a forward runs as
(docs/design.md, "The attention seam") and hands it to the model in the
forward context (``metadata_extra``); the model reads it back with
``attention_metadata(builder)``, typed by the builder. ``pad_offsets`` and
``pad_rows`` pad a builder's per-request tensors as graphs read them.
"""

from __future__ import annotations

from typing import Final, NamedTuple, TypeVar, cast

import torch

from cudagraph_dispatch import get_forward_context
from cudagraph_dispatch.lowlevel import check_int
from cudagraph_dispatch.support import AttentionSupport

from .._values._batch import BatchShape, StepBatch
from .._values._inputs import check_pad_value
from .._values._protocols import AttentionMetadataBuilder

M = TypeVar("M")

#: The forward context's extra that carries the step's metadata (``attention_metadata`` reads it).
METADATA_EXTRA: Final = "attention_metadata"


class _Built(NamedTuple):
    """What the forward context carries: the builder, and the metadata it built for this forward."""

    builder: object
    metadata: object


#: What a builder's ``build`` never returns as its metadata ``M``: nothing, a plain container or a
#: scalar (``return meta, extra`` or a missing ``return``). A dataclass, a NamedTuple or a tensor is fine.
NOT_METADATA: Final = frozenset({type(None), tuple, list, dict, set, frozenset, str, bytes, bool, int, float})


def metadata_extra(builder: object, metadata: object, *, call: str = "build") -> dict[str, object]:
    """The forward-context extras that carry ``metadata`` built by ``builder``.

    Args:
        builder: the ``AttentionMetadataBuilder`` that built it.
        metadata: what ``builder``'s ``call`` returned.
        call: ``"build"`` or ``"build_for_capture"``, for the error.

    Returns:
        ``set_forward_context``'s extras: ``attention_metadata(builder)`` reads
        ``metadata`` back inside the forward.

    Raises:
        ValueError: ``metadata`` is one of ``NOT_METADATA``'s types (naming the
            call, before the model could read it), or ``builder`` is no
            ``AttentionMetadataBuilder``.
    """
    if builder is None:
        raise ValueError("builder: expected an AttentionMetadataBuilder, got None")
    check_builder("builder", builder)
    return _checked_extra(builder, metadata, call)


def build_extra(
    builder: AttentionMetadataBuilder[object] | None, batch: StepBatch, shape: BatchShape
) -> dict[str, object]:
    """The forward-context extras that carry ``builder``'s metadata of ``batch`` run as ``shape``.

    ``{}`` without a builder. An eager forward's, a warm-up's and a decode
    loop's (a replay checks its graph's metadata type: ``PlannedGraph.build``).
    The builder was checked with the options: only its product is.
    """
    return {} if builder is None else _checked_extra(builder, builder.build(batch, shape), "build")


def _checked_extra(builder: object, metadata: object, call: str) -> dict[str, object]:
    """``carried_extra`` once ``metadata`` is none of ``NOT_METADATA``'s types (else naming ``call``)."""
    if type(metadata) in NOT_METADATA:
        raise ValueError(not_metadata(builder, metadata, call))
    return carried_extra(builder, metadata)


def carried_extra(builder: object, metadata: object) -> dict[str, object]:
    """The extras carrying ``metadata`` of ``builder``, unchecked (a replay's: its graph checked the type)."""
    return {METADATA_EXTRA: _Built(builder, metadata)}


def check_builder(name: str, builder: object) -> AttentionMetadataBuilder[object] | None:
    """``builder`` if it is ``None`` or has the protocol's members; else ``ValueError`` naming ``name``."""
    if builder is None:
        return None
    if isinstance(builder, type):  # its methods would be called unbound: build(batch) as build(self=batch)
        raise ValueError(
            f"{name}: expected an AttentionMetadataBuilder instance, got the class {builder.__name__}; "
            f"pass an instance ({builder.__name__}(...))"
        )
    lacks = [
        f"{member}()"
        for member in ("build", "build_for_capture")
        if not callable(getattr(builder, member, None))
    ]
    if not isinstance(getattr(builder, "support", None), AttentionSupport):
        lacks.append("a support of type AttentionSupport")
    if lacks:
        raise ValueError(
            f"{name}: expected an AttentionMetadataBuilder, got {builder!r:.80}, "
            f"which lacks {', '.join(lacks)}"
        )
    return builder  # type: ignore[return-value]  # checked above: the protocol's members exist


def not_metadata(builder: object, metadata: object, call: str) -> str:
    """Why ``metadata`` (``builder.<call>()``'s product) is no attention metadata."""
    return (
        f"{type(builder).__name__}.{call}: returned {metadata!r:.80} (a {type(metadata).__name__}); "
        "an AttentionMetadataBuilder returns its own metadata object (a dataclass, a NamedTuple, a "
        "tensor), which the model reads with attention_metadata(builder)"
    )


def other_metadata(builder: object, metadata: object, recorded: type | None) -> str:
    """Why a replay's ``build`` product is refused: not the type its graph was recorded with."""
    if type(metadata) in NOT_METADATA:
        return not_metadata(builder, metadata, "build")
    expected = "no metadata" if recorded is None else f"a {recorded.__name__}"
    return (
        f"{type(builder).__name__}.build: returned {metadata!r:.80} (a {type(metadata).__name__}), but "
        f"this graph was recorded with {expected} from build_for_capture; build returns the type "
        "build_for_capture returns (the graph's model reads it as the recording did)"
    )


def attention_metadata(builder: AttentionMetadataBuilder[M]) -> M:
    """The metadata ``builder`` built for the forward running now (inside the model's forward).

    The manager sets it on every path: captures, warm-ups, replays of
    PIECEWISE graphs (their eager attention reads it), eager steps.

    Args:
        builder: the builder whose metadata the forward reads.

    Returns:
        Its metadata, of the builder's own type ``M``.

    Raises:
        RuntimeError: outside such a forward, or the metadata is another builder's.
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

    ``offsets [n + 1]`` (integers) are the real batch's (``offsets[0] == 0``,
    non-decreasing, the last the real total); ``out [padded_reqs + 1]``
    (integers, ``padded_reqs >= n``) gets them, then ``padded_total`` in
    every row after: the first padding request holds every padding token,
    the others none, and the last offset is the padded total, as a kernel
    over the padded batch reads it. Where the padded batch has no padding
    request (``padded_reqs == n``), no row can hold the padding tokens: the
    last offset stays the real total, and the tokens past it belong to no
    request (docs/design.md, "The attention seam").

    Device ops on the current stream, no host synchronization.

    Args:
        out: ``[padded_reqs + 1]`` integers, written.
        offsets: ``[n + 1]`` integers, the real batch's.
        padded_total: the padded batch's tokens.

    Returns:
        ``out``.

    Raises:
        ValueError: naming an argument of the wrong type, shape, dtype or
            device; the values of ``offsets`` (from 0, non-decreasing, at most
            ``padded_total``) are checked only on the CPU (on a device, reading
            them would synchronize).
    """
    _check_offsets(out, offsets, padded_total)
    real = offsets.shape[0]
    out[:real].copy_(offsets)
    out[real:].fill_(padded_total)
    return out


def pad_rows(out: torch.Tensor, rows: torch.Tensor, pad_value: int | float) -> torch.Tensor:
    """``rows`` into the first rows of ``out``, ``pad_value`` in the rest; returns ``out``.

    Device ops on the current stream, no host synchronization.

    Args:
        out: ``[padded, *trailing]``, written.
        rows: ``[n, *trailing]`` (``n <= padded``) on ``out``'s device, of a
            dtype that casts to ``out``'s without changing kind (no floats
            into integers).
        pad_value: what the padding rows get; ``out``'s dtype holds it exactly.

    Returns:
        ``out``.

    Raises:
        ValueError: naming the wrong argument; nothing is written then.
    """
    _check_rows(out, rows, pad_value)
    real = rows.shape[0]
    out[:real].copy_(rows)
    out[real:].fill_(pad_value)
    return out


def _tensor(name: str, value: object, *, least_dims: int) -> torch.Tensor:
    """``value`` if it is a tensor of ``least_dims`` dims or more; else ``ValueError`` naming ``name``."""
    if not isinstance(value, torch.Tensor) or value.dim() < least_dims:
        what = f"a {value.dim()}-d tensor" if isinstance(value, torch.Tensor) else f"{value!r:.80}"
        raise ValueError(f"{name}: expected a tensor of at least {least_dims} dimension(s), got {what}")
    return value


def _integers(name: str, tensor: torch.Tensor) -> None:
    """``ValueError`` naming ``name`` unless ``tensor`` is a 1-D tensor of integers (not bool)."""
    dtype = tensor.dtype
    if tensor.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype is torch.bool:
        raise ValueError(
            f"{name}: expected a 1-D tensor of integers (cumulative offsets), "
            f"got shape {tuple(tensor.shape)} of {dtype}"
        )


def _same_device(name: str, tensor: torch.Tensor, out: torch.Tensor) -> None:
    if tensor.device != out.device:
        raise ValueError(f"{name}: on {tensor.device}, but out is on {out.device} (a copy would synchronize)")


def _check_offsets(out: object, offsets: object, padded_total: object) -> None:
    """``pad_offsets``' arguments, each named in a ``ValueError``; their values on the CPU only."""
    out_t, offsets_t = _tensor("out", out, least_dims=1), _tensor("offsets", offsets, least_dims=1)
    _integers("out", out_t)
    _integers("offsets", offsets_t)
    _same_device("offsets", offsets_t, out_t)
    real, rows = offsets_t.shape[0], out_t.shape[0]
    if real < 1 or real > rows:
        raise ValueError(
            f"offsets: expected between 1 and {rows} rows (the padded batch's requests + 1), got {real}"
        )
    total = check_int("padded_total", padded_total, minimum=0, maximum=torch.iinfo(out_t.dtype).max)
    if offsets_t.device.type != "cpu":  # the values: free on the CPU; on a device a read synchronizes
        return
    if int(offsets_t[0]) != 0:
        raise ValueError(f"offsets: expected to start at 0, got {offsets_t.tolist()!r:.80}")
    if real > 1 and bool((offsets_t[1:] < offsets_t[:-1]).any()):
        raise ValueError(f"offsets: expected non-decreasing offsets, got {offsets_t.tolist()!r:.80}")
    if int(offsets_t[-1]) > total:
        raise ValueError(
            f"padded_total: {total} is below the real total {int(offsets_t[-1])} (the last offset)"
        )


def _check_rows(out: object, rows: object, pad_value: object) -> None:
    """``pad_rows``' arguments, each named in a ``ValueError``."""
    out_t, rows_t = _tensor("out", out, least_dims=1), _tensor("rows", rows, least_dims=1)
    if rows_t.shape[1:] != out_t.shape[1:]:
        raise ValueError(
            f"rows: shape {tuple(rows_t.shape)} does not match out's {tuple(out_t.shape)} past the rows "
            "(a row is copied whole, never broadcast)"
        )
    if rows_t.shape[0] > out_t.shape[0]:
        raise ValueError(f"rows: {rows_t.shape[0]} rows do not fit the {out_t.shape[0]} of the padded batch")
    bool_into_other = rows_t.dtype == torch.bool and out_t.dtype != torch.bool
    if bool_into_other or not torch.can_cast(rows_t.dtype, out_t.dtype):
        raise ValueError(
            f"rows: {rows_t.dtype} rows do not fit out's {out_t.dtype} (a copy would round or recast them)"
        )
    _same_device("rows", rows_t, out_t)
    check_pad_value(pad_value, out_t.dtype)
    _check_row_range(rows_t, out_t.dtype)


def _check_row_range(rows: torch.Tensor, dtype: torch.dtype) -> None:
    """Integer ``rows`` into a narrower integer ``dtype``: each value must fit (checked on the CPU only)."""
    if rows.device.type != "cpu" or rows.dtype == dtype or not rows.numel():
        return  # on a device, reading the values would synchronize
    if rows.dtype.is_floating_point or rows.dtype == torch.bool or dtype.is_floating_point:
        return
    info = torch.iinfo(dtype)
    low, high = int(rows.min()), int(rows.max())
    if low < info.min or high > info.max:
        raise ValueError(f"rows: values in [{low}, {high}] do not fit out's {dtype} [{info.min}, {info.max}]")
