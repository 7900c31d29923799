"""A decode kernel planned on the host: the backend that graphs decodes and nothing else.

Uniform batches of one token per request run flash-decoding in torch ops
(``split_decode_attention``): each request's pages are gathered, the key
axis is cut into ``num_splits`` chunks, each chunk's partial maximum,
exponent sum and output are combined by log-sum-exp. The split count is a
host value chosen from the padded request count (``split_count``: more
splits for fewer requests, to keep the device busy), so it depends on the
shape alone and a FULL graph may bake it.

Every other batch (prefill chunks, mixed, spec decode) takes the prefill
path, ``prefill=``:

- ``"varlen"`` (the default): the varlen backend's packed FlashAttention
  (``VarlenPagedAttention``, composed: its metadata and kernel, sharing
  this backend's buffers), one kernel per layer whose work follows the
  batch's real lengths, with no host synchronization;
- ``"planned"``: a path planned on the host from the real batch
  (``planned_attention``): the query offsets are read once per step (one
  synchronization), then each request attends on its own, one after the
  other (slow: a loop of small kernels per request and layer).

The backend declares ``UNIFORM_SINGLE_TOKEN_DECODE`` either way (the paged
backend below ``ALWAYS``, whose FULL mode the manager downgrades): FULL
graphs serve decodes, mixed batches run PIECEWISE (the attention runs
eagerly between segments, ``breakable``) or eagerly. The varlen path would
also hold in a FULL graph of a mixed key (``declare=ALWAYS`` is then true);
the planned one would not: ``declare=`` over-declares it for tests of that
level check, whose FULL graph of a mixed key bakes the plan of its capture
(every token in the first request, the padding batch's) and replays it,
wrong, for whatever batch it serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final, Literal

import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager.attention import BatchShape, StepBatch, attention_metadata

from .base import EagerBreakAttention
from .batch import PagedBuffers, PagedMetadata, Validate
from .layout import PagedLayout
from .varlen import VarlenMetadata, VarlenPagedAttention
from .varlen_kernels import causal_rows

#: The prefill paths of ``SplitDecodeAttention`` (``prefill=``).
Prefill = Literal["varlen", "planned"]
_PREFILLS: Final = ("varlen", "planned")

#: Request-chunk work items the decode kernel aims for: ``split_count`` splits keys until
#: requests times splits reaches this.
_TARGET_ITEMS: Final = 64


def split_count(num_reqs: int, pages_per_seq: int) -> int:
    """The decode kernel's split count for ``num_reqs`` requests: a power of two in ``[1, pages_per_seq]``.

    More splits for fewer requests, so that requests times splits reaches
    a fixed target; never more splits than a block-table row has pages
    (each split reads whole pages). A function of the shape alone.
    """
    wanted = max(1, _TARGET_ITEMS // max(num_reqs, 1))
    splits = 1 << (min(wanted, pages_per_seq).bit_length() - 1)  # the power of two at or below
    return splits


def split_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_splits: int,
) -> torch.Tensor:
    """Flash-decoding of one query per request: ``[R, heads, head_dim]``, in ``q``'s dtype.

    ``q [R, heads, head_dim]``; ``kv_cache [2, num_pages, page_size, heads,
    head_dim]``; ``seq_lens [R]`` keys per request (at least one);
    ``block_table [R, pages_per_seq]``. The row's pages are cut into
    ``num_splits`` chunks of whole pages (the row padded with the scratch
    page); each chunk's softmax is taken apart and the chunks combined by
    their log-sum-exp. Computed in float32; fixed shapes, no host sync.
    """
    num_reqs, heads, head_dim = q.shape
    width, page_size = block_table.shape[1], kv_cache.shape[2]
    per_split = -(-width // num_splits)  # pages per chunk
    table = torch.full(
        (num_reqs, per_split * num_splits), PagedLayout.scratch_page, dtype=torch.long, device=q.device
    )
    table[:, :width] = block_table
    chunk = per_split * page_size  # keys per chunk
    # One contiguous copy, whatever the cache's strides (a cache whose slots hold every layer too).
    pages = kv_cache.index_select(1, table.flatten()).float()  # [2, R * S * C, page_size, heads, head_dim]
    keys, values = pages.view(2, num_reqs, num_splits, chunk, heads, head_dim).unbind(0)  # [R, S, K, h, d]
    scores = torch.einsum("rhd,rskhd->rhsk", q.float(), keys) * head_dim**-0.5  # [R, heads, S, K]
    position = torch.arange(num_splits * chunk, device=q.device).view(num_splits, chunk)  # [S, K]
    visible = position[None] < seq_lens[:, None, None]  # [R, S, K]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    peak = scores.amax(-1)  # [R, heads, S]: -inf for a chunk past the request's keys
    peak = torch.where(peak.isfinite(), peak, 0.0)
    weights = torch.exp(scores - peak[..., None])  # [R, heads, S, K]: 0 where hidden
    total = weights.sum(-1)  # [R, heads, S]
    partial = torch.einsum("rhsk,rskhd->rhsd", weights, values) / total.clamp(min=1e-30)[..., None]
    lse = torch.where(total > 0, peak + total.clamp(min=1e-30).log(), float("-inf"))  # [R, heads, S]
    share = torch.softmax(lse, dim=-1)  # [R, heads, S]: each chunk's part of the whole softmax
    out = torch.einsum("rhs,rhsd->rhd", share, partial)  # [R, heads, head_dim]
    return out.to(q.dtype)


def planned_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    starts: Sequence[int],
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """Causal attention one request at a time, as the host plan ``starts`` cuts the queries.

    ``starts`` (``R + 1`` host offsets, the last the total): request ``r``
    has queries ``starts[r]:starts[r + 1]``, the last of its ``seq_lens[r]``
    positions (a device value, read in the mask). ``q [T, heads, head_dim]``,
    the other arguments as ``split_decode_attention``'s. Rows that see no
    key (a padding request's first) are zeros. A graph would bake ``starts``.
    """
    out = torch.zeros_like(q)
    heads, head_dim = q.shape[1], q.shape[2]
    for r in range(len(starts) - 1):
        first, last = starts[r], starts[r + 1]
        if first == last:
            continue
        pages = kv_cache[:, block_table[r].long()]  # [2, pages_per_seq, page_size, heads, head_dim]
        keys, values = pages.reshape(2, -1, heads, head_dim).unbind(0)  # [pages_per_seq * page_size, h, d]
        out[first:last] = causal_rows(q[first:last], keys, values, seq_lens[r])
    return out


def shape_plan(shape: BatchShape) -> tuple[int, ...]:
    """The query offsets a shape alone implies: uniform, or the padding batch's (every token in request 0)."""
    if shape.query_len is not None:
        return tuple(r * shape.query_len for r in range(shape.num_reqs + 1))
    return (0, *([shape.num_tokens] * shape.num_reqs))


@dataclasses.dataclass(frozen=True, slots=True)
class SplitDecodeMetadata:
    """``SplitDecodeAttention``'s metadata: the paged batch, and the plan of the path it takes.

    ``num_splits``: the decode kernel's split count (uniform shapes of one
    token per request), else ``None`` and a prefill path runs: ``prefill``,
    the varlen backend's metadata of the batch where that path is varlen's,
    else the planned path's ``plan``: its query offsets on the host where
    the shape implies them (a FULL graph's), else ``None``: the step's first
    attention reads them (one sync, eager) and keeps them in ``read`` for
    the other layers (a new value per build).
    """

    paged: PagedMetadata
    num_splits: int | None
    plan: tuple[int, ...] | None
    read: list[tuple[int, ...]] = dataclasses.field(default_factory=list, compare=False)
    prefill: VarlenMetadata | None = None


class SplitDecodeAttention(EagerBreakAttention):
    """Flash-decoding for decodes, a prefill path for the rest: a ``PagedBackend`` below ``ALWAYS``.

    Arguments:
        layout: the cache's paging (any page size).
        max_tokens, max_reqs: the largest batch; the buffers are sized once for it.
        device: where the buffers live.
        breakable: ``attend`` is an eager break, so PIECEWISE graphs serve mixed batches.
        declare: the level it declares (default: ``UNIFORM_SINGLE_TOKEN_DECODE``); ``ALWAYS`` holds
            with the varlen prefill path, and over-declares the planned one (tests of the level check).
        prefill: the path of the batches that are not decodes: ``"varlen"`` (default; the varlen
            backend's, on its gathered or paged path as it chooses) or ``"planned"`` (on the host).
        validate: ``PagedBuffers.validate``: ``"eager"`` (``True``) checks eager steps at once and
            leaves a graph path's unchecked; ``"device"`` also records a graph path's on the
            device, no synchronization (``check_steps``); ``"host"`` synchronizes once on every
            path; ``False`` does not check.
        page_limit: the pages backed (``KVCacheMemory.limit``) of a cache over reserved
            memory: a block-table entry outside ``[0, page_limit)`` reads the scratch page.
        vocab_size: the model's vocabulary: where a step is checked on the host, its
            ``input_ids`` are too (``PagedBuffers``; ``None``: not).
    """

    def __init__(
        self,
        layout: PagedLayout,
        *,
        max_tokens: int,
        max_reqs: int,
        device: torch.device | str | None = None,
        breakable: bool = True,
        declare: GraphSupport = GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        validate: Validate = True,
        prefill: Prefill = "varlen",
        page_limit: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if prefill not in _PREFILLS:
            raise ValueError(f"prefill: expected one of {list(_PREFILLS)}, got {prefill!r:.80}")
        super().__init__(breakable=breakable)
        self.layout: Final = layout
        self.support: Final = AttentionSupport(declare, piecewise=breakable, name="split_decode")
        # The varlen prefill path's backend, whose buffers are this one's; None: the planned path.
        self._prefill: Final = (
            VarlenPagedAttention(
                layout,
                max_tokens=max_tokens,
                max_reqs=max_reqs,
                device=device,
                breakable=False,
                validate=validate,
                page_limit=page_limit,
                vocab_size=vocab_size,
            )
            if prefill == "varlen"
            else None
        )
        self.buffers: Final = (
            PagedBuffers(
                layout,
                max_tokens,
                max_reqs,
                device,
                validate=validate,
                page_limit=page_limit,
                vocab_size=vocab_size,
            )
            if self._prefill is None
            else self._prefill.buffers
        )

    def build(self, batch: StepBatch, shape: BatchShape, /) -> SplitDecodeMetadata:
        """``batch`` padded to ``shape`` (device ops); the prefill path's metadata as ``_metadata`` says."""
        if self._prefill is not None and not self._decode(shape):
            return self._varlen(self._prefill.build(batch, shape))
        return self._metadata(self.buffers.fill(batch, shape))

    def build_for_capture(self, shape: BatchShape, /) -> SplitDecodeMetadata:
        """The buffers of ``shape`` as they are (host only)."""
        if self._prefill is not None and not self._decode(shape):
            return self._varlen(self._prefill.build_for_capture(shape))
        return self._metadata(self.buffers.views(shape))

    def request_rows(self) -> tuple[torch.Tensor, ...]:
        """The metadata rows a shrinking decode loop moves with its requests (``PagedBuffers``')."""
        return self.buffers.request_rows()

    @staticmethod
    def _varlen(prefill: VarlenMetadata) -> SplitDecodeMetadata:
        return SplitDecodeMetadata(prefill.paged, None, None, prefill=prefill)

    def _decode(self, shape: BatchShape) -> bool:
        return shape.query_len == 1

    def _metadata(self, paged: PagedMetadata) -> SplitDecodeMetadata:
        """The decode kernel's split count for decodes; else the planned path's plan.

        A FULL graph (only where ``declare`` over-declares) bakes the plan
        its shape implies; elsewhere the step's first attention reads it
        from the batch, eagerly.
        """
        shape = paged.shape
        if self._decode(shape):
            return SplitDecodeMetadata(paged, split_count(shape.num_reqs, self.layout.pages_per_seq), None)
        plan = shape_plan(shape) if shape.mode is CUDAGraphMode.FULL else None
        return SplitDecodeMetadata(paged, None, plan)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        meta = attention_metadata(self)
        paged = meta.paged
        if meta.num_splits is not None:  # one token per request: T == R
            out.copy_(split_decode_attention(q, kv_cache, paged.seq_lens, paged.block_table, meta.num_splits))
            return
        if meta.prefill is not None and self._prefill is not None:  # the varlen path: no plan, no sync
            self._prefill.attend_with(meta.prefill, q, kv_cache, out)
            return
        if meta.plan is None and not meta.read:
            meta.read.append(tuple(paged.query_start_loc.tolist()))  # the step's one sync
        plan = meta.plan if meta.plan is not None else meta.read[0]
        out.copy_(planned_attention(q, kv_cache, plan, paged.seq_lens, paged.block_table))
