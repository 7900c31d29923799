"""Gather + SDPA over the pages: each token's pages read whole, then SDPA with a mask (runs anywhere).

The toy attention of ``reference.py``, on pages: every token reads
``pages_per_seq`` pages (those past its position replaced by the scratch
page and masked), so the shapes are fixed and a FULL graph serves any batch
(``ALWAYS``). Its metadata (``GatherMetadata``) is ``PagedMetadata`` as
``PagedBuffers`` fills it; the per-token page table and mask are derived
from it inside the forward, once per step (the first layer's attention),
with capturable ops: a FULL graph rebuilds them on every replay.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Final, NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager.attention import BatchShape, StepBatch, attention_metadata

from .base import EagerBreakAttention, per_forward
from .batch import PagedBuffers, PagedMetadata, Validate
from .layout import PagedLayout


def token_pages(layout: PagedLayout, meta: PagedMetadata) -> torch.Tensor:
    """``[T, pages_per_seq]`` int64: each token's pages up to its position, the scratch page elsewhere."""
    width = meta.block_table.shape[1]
    rows = meta.block_table[meta.req_ids.clamp(min=0)].long()  # [T, M]
    columns = torch.arange(width, device=rows.device)  # [M]
    visible = (meta.req_ids >= 0)[:, None] & (columns[None, :] * layout.page_size <= meta.positions[:, None])
    return torch.where(visible, rows, layout.scratch_page)


class _GatherPlan(NamedTuple):
    pages: torch.Tensor  # [T, pages_per_seq] int64: each token's pages, scratch beyond its position
    mask: torch.Tensor  # [T, 1, 1, pages_per_seq * page_size] additive


@dataclasses.dataclass(frozen=True, slots=True)
class GatherMetadata:
    """``GatherPagedAttention``'s metadata: the step's ``PagedMetadata`` and what the forward derives.

    ``derived`` holds the page table and mask once the first layer of a
    forward built them, for the other layers of that forward (keyed by its
    forward context: the next forward derives them again).
    """

    paged: PagedMetadata
    derived: list[tuple[object, _GatherPlan]] = dataclasses.field(default_factory=list, compare=False)


class GatherPagedAttention(EagerBreakAttention):
    """Each token's pages gathered whole, then SDPA with a mask: the toy attention, on pages.

    Arguments:
        layout: the cache's paging.
        dtype: the model's (the mask's: SDPA adds it as is).
        max_tokens, max_reqs: the largest batch its metadata buffers hold.
        device: where they live.
        breakable: ``attend`` is an eager break (a PIECEWISE capture runs it
            between segments); False records it inline in every capture.
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
        dtype: torch.dtype,
        *,
        max_tokens: int,
        max_reqs: int,
        device: torch.device | str | None = None,
        breakable: bool = True,
        validate: Validate = True,
        page_limit: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(breakable=breakable)
        #: The cache's paging (``resize`` changes its page count).
        self.layout = layout
        self.dtype: Final = dtype
        self.support: Final = AttentionSupport(GraphSupport.ALWAYS, piecewise=breakable, name="gather_sdpa")
        #: Metadata buffers of a layout, sized for the largest batch.
        self._new_buffers: Final = functools.partial(
            PagedBuffers,
            max_tokens=max_tokens,
            max_reqs=max_reqs,
            device=device,
            validate=validate,
            page_limit=page_limit,
            vocab_size=vocab_size,
        )
        self.buffers = self._new_buffers(layout)

    def resize(self, num_pages: int) -> None:
        """Serve a cache of ``num_pages`` pages: new buffers (before any capture: graphs read the old)."""
        layout = dataclasses.replace(self.layout, num_pages=num_pages)
        buffers = self._new_buffers(layout)  # first: all or nothing
        self.layout, self.buffers = layout, buffers

    def build(self, batch: StepBatch, shape: BatchShape, /) -> GatherMetadata:
        return GatherMetadata(self.buffers.fill(batch, shape))

    def build_for_capture(self, shape: BatchShape, /) -> GatherMetadata:
        return GatherMetadata(self.buffers.views(shape))

    def request_rows(self) -> tuple[torch.Tensor, ...]:
        """The metadata rows a shrinking decode loop moves with its requests (``PagedBuffers``')."""
        return self.buffers.request_rows()

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        meta = attention_metadata(self)
        pages, mask = per_forward(meta.derived, lambda: self._plan(meta.paged))
        num_tokens, heads, head_dim = q.shape
        # One contiguous copy, whatever the cache's strides (a cache whose slots hold every layer too).
        rows = kv_cache.index_select(1, pages.flatten())  # [2, T * M, page, heads, head_dim]
        rows = rows.view(2, num_tokens, -1, heads, head_dim).transpose(2, 3)  # [2, T, heads, M * page, dim]
        result = F.scaled_dot_product_attention(q.unsqueeze(2), rows[0], rows[1], attn_mask=mask)
        out.copy_(result.squeeze(2))  # [T, heads, head_dim]

    def _plan(self, meta: PagedMetadata) -> _GatherPlan:
        pages = token_pages(self.layout, meta)  # [T, M]
        logical = torch.arange(pages.shape[1] * self.layout.page_size, device=pages.device)  # [M * page]
        hidden = logical[None, :] > meta.positions[:, None]  # [T, M * page]
        mask = hidden.to(self.dtype).mul_(torch.finfo(self.dtype).min)
        return _GatherPlan(pages, mask[:, None, None, :])
