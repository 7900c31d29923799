"""torch's FlexAttention over the pages, on the attention seam: a block mask built from tensors.

Uniform shapes (``shape.query_len`` set: every request, padding included,
has ``q`` tokens) attend as ``[R, heads, q, head_dim]`` queries, one batch
row per request, whose block-mask row is the request's block table: each
request reads its own pages and nothing else (the decode kernel). Other
shapes attend as one packed sequence of ``T`` queries; each tile of 16
queries reads the union of its tokens' pages, and the mask keeps each token
to its own request's keys up to its position.

The metadata (``FlexMetadata``) is ``PagedMetadata`` as ``PagedBuffers``
fills it, and the cache's slot-to-page table. What the block mask needs
(page owners, tile unions) is derived from it inside the forward, once per
step (the first layer's attention), with capturable ops: a FULL graph
rebuilds it on every replay, at no host cost; and since the mask is built
from fixed-shape tensors, a FULL graph serves any batch: ``ALWAYS``. The
kernel, and the mask it makes from these tensors, is ``flex_kernel``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Final, NamedTuple

import torch

from cudagraph_dispatch.lowlevel import check_bool
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager.attention import BatchShape, StepBatch, attention_metadata

from .base import EagerBreakAttention, per_forward
from .batch import PAD_REQUEST, PagedBuffers, PagedMetadata, Validate
from .flex_kernel import KEY_BLOCK, Q_TILE, addressable_slots, paged_flex
from .flex_kernel import compile_class as kernel_class
from .gather import token_pages
from .layout import PagedLayout, page_of_slot


class _FlexPlan(NamedTuple):
    """What the block mask reads, derived from ``PagedMetadata`` once per forward."""

    kv_num_blocks: torch.Tensor  # [B, 1, tiles] int32: pages each query tile reads
    kv_indices: torch.Tensor  # [B, 1, tiles, width] int32: which (the first kv_num_blocks)
    owner: torch.Tensor  # [num_pages] int64: the request that owns each page, PAD_REQUEST if none
    page_shift: torch.Tensor  # [num_pages] int64: a slot's position in its request, minus the slot
    page_of_slot: torch.Tensor  # [num_pages * page_size] int32: each slot's page
    query_req: torch.Tensor  # [B, Q]: each query's request
    query_pos: torch.Tensor  # [B, Q]: each query's position


@dataclasses.dataclass(frozen=True, slots=True)
class FlexMetadata:
    """``FlexPagedAttention``'s metadata: the step's ``PagedMetadata``, the cache's slot-to-page table.

    ``derived`` holds the block mask's inputs once the first layer of a
    forward built them, for the other layers of that forward (keyed by its
    forward context: the next forward derives them again).
    """

    paged: PagedMetadata
    page_of_slot: torch.Tensor  # [num_pages * page_size] int32 (``page_of_slot``)
    derived: list[tuple[object, _FlexPlan]] = dataclasses.field(default_factory=list, compare=False)


def page_owners(layout: PagedLayout, meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each page's owner request and its place in the owner's block-table row, ``[num_pages]`` int64 each.

    Capturable ops (scatters, no host sync). Only the entries a request uses
    (``i * page_size < seq_len``) claim a page; the rest of a row is
    ignored, whatever it holds. The scratch page belongs to no request, at
    index 0, so padding tokens read its first slot.
    """
    block_table, seq_lens = meta.block_table, meta.seq_lens
    num_reqs, width = block_table.shape
    device = block_table.device
    columns = torch.arange(width, device=device)  # [M]
    used = columns[None, :] * layout.page_size < seq_lens[:, None]  # [R, M]
    # Unused entries scatter into one extra, dropped element.
    target = torch.where(used, block_table.long(), layout.num_pages).flatten()  # [R * M]
    owner = torch.full((layout.num_pages + 1,), PAD_REQUEST, dtype=torch.int64, device=device)
    owner.scatter_(0, target, torch.arange(num_reqs, device=device).repeat_interleave(width))
    page_index = torch.zeros(layout.num_pages + 1, dtype=torch.int64, device=device)
    page_index.scatter_(0, target, columns.repeat(num_reqs))
    # Fills of a slice, which a capture records (a setitem of a Python number would copy from
    # the host).
    scratch = slice(layout.scratch_page, layout.scratch_page + 1)
    owner, page_index = owner[: layout.num_pages], page_index[: layout.num_pages]
    owner[scratch].fill_(PAD_REQUEST)
    page_index[scratch].fill_(0)
    return owner, page_index


def tile_unions(pages: torch.Tensor, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query tile's distinct pages, first, and how many: ``[1, 1, tiles]``, ``[1, 1, tiles, 16 * M]``.

    ``pages [T, M]`` are the tokens' pages. Sorted per tile, a page equal to
    the one before it is a repeat; repeats are moved to the end (sorted
    again under a key past every page) and not counted. Fixed shapes, no
    host sync: the width is the tile's tokens times their pages, never the
    cache's page count.
    """
    num_tokens, width = pages.shape
    tiles = -(-num_tokens // Q_TILE)
    padded = torch.full((tiles * Q_TILE, width), scratch, dtype=pages.dtype, device=pages.device)
    padded[:num_tokens] = pages
    ordered = padded.view(tiles, Q_TILE * width).sort(dim=-1).values  # [tiles, 16 * M]
    repeat = torch.cat(
        (torch.zeros_like(ordered[:, :1], dtype=torch.bool), ordered[:, 1:] == ordered[:, :-1]), -1
    )
    past = torch.iinfo(torch.int32).max
    distinct = torch.where(repeat, past, ordered).sort(dim=-1).values  # [tiles, 16 * M]: distinct, then past
    kv_indices = torch.where(distinct == past, scratch, distinct).int()
    kv_num_blocks = (~repeat).sum(-1, dtype=torch.int32)
    return kv_num_blocks[None, None], kv_indices[None, None]


def check_addressable(keys: torch.Tensor) -> None:
    """``ValueError`` naming ``kv_cache`` where the fused kernel cannot address ``keys`` (32-bit offsets).

    ``keys``: ``[1, heads, slots, head_dim]``, a view of one layer's cache.
    """
    slots, stride = keys.shape[2], keys.stride(2)
    if slots > addressable_slots(stride):
        raise ValueError(
            f"kv_cache: FlexAttention's fused kernel addresses keys with 32-bit offsets "
            f"(pytorch/pytorch#185264, in torch up to 2.13): {slots} slots a key stride of {stride} "
            f"elements apart are past its {addressable_slots(stride)}; give the cache fewer pages "
            "(reserve_paged_cache(..., max_pages=max_flex_pages(...))), or use the gather, varlen or "
            "split_decode backend"
        )


class FlexPagedAttention(EagerBreakAttention):
    """torch's FlexAttention over the pages, its block mask built in the forward from ``PagedMetadata``.

    Arguments:
        layout: the cache's paging; on CUDA its page size must be a multiple
            of 64 (the kernel's key block, ``flex_kernel.KEY_BLOCK``).
        max_tokens, max_reqs: the largest batch its metadata buffers hold.
        device: where they (and the slot-to-page table) live.
        compile: run the fused Triton kernels (default: on CUDA); eager
            FlexAttention is a slow reference for CPU tests.
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
        *,
        max_tokens: int,
        max_reqs: int,
        device: torch.device | str | None = None,
        compile: bool | None = None,
        breakable: bool = True,
        validate: Validate = True,
        page_limit: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(breakable=breakable)
        if compile is not None:
            check_bool("compile", compile)
        #: The cache's paging (``resize`` changes its page count).
        self.layout = layout
        self.support: Final = AttentionSupport(
            GraphSupport.ALWAYS, piecewise=breakable, name="flex_attention"
        )
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
        #: Each slot's page (``page_of_slot``): the mask reads a key's page from it.
        self.page_of_slot = page_of_slot(layout, device)
        #: Whether ``attend`` runs the fused (compiled) kernel.
        self.compiled: Final = self.page_of_slot.is_cuda if compile is None else compile
        if self.compiled and layout.page_size % KEY_BLOCK:
            raise ValueError(
                f"page_size: FlexAttention's fused kernel reads keys in blocks of {KEY_BLOCK}, so its "
                f"pages hold a multiple of {KEY_BLOCK} keys; got {layout.page_size} (pages of any size: "
                "the gather, varlen or split_decode backends)"
            )

    def resize(self, num_pages: int) -> None:
        """Serve a cache of ``num_pages`` pages: new buffers (before any capture: graphs read the old).

        All or nothing: where an allocation fails, the layout is the old one.
        """
        layout, device = dataclasses.replace(self.layout, num_pages=num_pages), self.page_of_slot.device
        self.page_of_slot = torch.empty(0, dtype=torch.int32, device=device)  # freed first
        try:
            table, buffers = page_of_slot(layout, device), self._new_buffers(layout)
        except BaseException:  # all or nothing: the old layout's table again
            self.page_of_slot = page_of_slot(self.layout, device)
            raise
        self.layout, self.page_of_slot, self.buffers = layout, table, buffers

    def build(self, batch: StepBatch, shape: BatchShape, /) -> FlexMetadata:
        return FlexMetadata(self.buffers.fill(batch, shape), self.page_of_slot)

    def build_for_capture(self, shape: BatchShape, /) -> FlexMetadata:
        return FlexMetadata(self.buffers.views(shape), self.page_of_slot)

    def compile_class(self, shape: BatchShape, /) -> object:
        """The compiled kernel's code ``shape`` runs (``flex_kernel.compile_class``; eager: one class).

        The manager warms one key per class up before recording the rest
        (``ManagerOptions.warm_ups``): a compile inside a recording would break it.
        """
        if not self.compiled:
            return None
        return kernel_class(shape.num_tokens, shape.num_reqs, shape.query_len)

    def request_rows(self) -> tuple[torch.Tensor, ...]:
        """The metadata rows a shrinking decode loop moves with its requests (``PagedBuffers``')."""
        return self.buffers.request_rows()

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        meta = attention_metadata(self)
        plan = per_forward(meta.derived, lambda: self._plan(meta))
        num_tokens, heads, head_dim = q.shape
        keys = kv_cache[0].view(1, -1, heads, head_dim).transpose(1, 2)  # [1, heads, pages * page, head_dim]
        values = kv_cache[1].view(1, -1, heads, head_dim).transpose(1, 2)
        if self.compiled:  # shapes only, on the host: no device work (a PIECEWISE replay's break runs it too)
            check_addressable(keys)
        query_len = meta.paged.shape.query_len
        if query_len is None:
            queries = q.transpose(0, 1)[None]  # [1, heads, T, head_dim]
        else:
            queries = q.view(-1, query_len, heads, head_dim).transpose(1, 2)  # [R, heads, q, head_dim]
        attend = paged_flex(self.layout.page_size, compiled=self.compiled)
        result = attend(queries, keys, values, *plan)  # [B, heads, Q, head_dim]
        out.copy_(result.transpose(1, 2).reshape(num_tokens, heads, head_dim))

    def _plan(self, meta: FlexMetadata) -> _FlexPlan:
        """The block mask's inputs for the step (capturable ops; nothing sized by the cache's pages)."""
        layout, paged = self.layout, meta.paged
        page_size, query_len = layout.page_size, paged.shape.query_len
        if query_len is not None:  # one batch row per request: its block-table row, its used pages
            num_reqs = paged.block_table.shape[0]
            tiles = -(-query_len // Q_TILE)
            counts = (paged.seq_lens.clamp(min=1) + page_size - 1) // page_size  # [R]
            kv_num_blocks = counts.int()[:, None, None].expand(num_reqs, 1, tiles)  # [R, 1, tiles]
            kv_indices = paged.block_table[:, None, None, :].expand(
                num_reqs, 1, tiles, -1
            )  # [R, 1, tiles, M]
            rows = (-1, query_len)
        else:  # one packed sequence: each query tile reads the union of its tokens' pages
            kv_num_blocks, kv_indices = tile_unions(token_pages(layout, paged), layout.scratch_page)
            rows = (1, paged.positions.shape[0])
        owner, page_index = page_owners(layout, paged)
        pages = torch.arange(owner.shape[0], device=owner.device)  # [num_pages]
        return _FlexPlan(
            kv_num_blocks.contiguous(),
            kv_indices.contiguous(),
            owner,
            (page_index - pages) * page_size,  # a key's position is this (of its page) + its slot
            meta.page_of_slot,
            paged.req_ids.view(rows),  # [B, Q]
            paged.positions.view(rows),  # [B, Q]
        )
