"""The reference decoder on a paged KV cache, with attention backends that say what they can graph.

Engines keep K/V in fixed-size pages: a request owns a list of pages (its row
of the block table), each token's K/V goes to a slot (``page * page_size +
offset``: the slot mapping), and the attention reads the pages through the
block table. The per-step metadata lives in static inputs that ``run()``
refills; the attention's own metadata (FlexAttention's block mask, the
gather's page table) is built from them inside the forward, with capturable
ops only, so a FULL graph rebuilds it on every replay.

- Inputs of one step: ``input_ids``, ``positions``, ``slot_mapping`` and
  ``req_ids`` (the token's request, a row of the block table) are ``[T]``;
  ``block_table [R, pages_per_seq]`` and ``seq_lens [R]`` (tokens in the
  request's context after this step) are per request. Tokens are grouped by
  request in block-table order, as engines lay them out; a token's position
  is below its request's ``seq_lens``; a page belongs to one request (no
  prefix sharing: FlexAttention's mask keeps a key to its page's one owner).
- Padding: tokens at position 0 of the scratch page (page 0) with request
  ``-1``; requests whose block-table rows are all the scratch page. Padding
  never reads or writes a real request's page.
- Backends (``PagedAttention``): ``FlexPagedAttention`` runs torch's
  FlexAttention (compiled to Triton kernels on CUDA) over the pages;
  ``GatherPagedAttention`` gathers each token's pages and runs SDPA with a
  mask (the toy attention of ``reference.py``, on pages). Each declares its
  ``AttentionSupport``, which ``PagedDecoder.graph_support()`` reports and
  the manager resolves its mode against.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Final, NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from cudagraph_capture import eager_break_during_capture
from cudagraph_dispatch import (
    AttentionSupport,
    BatchDescriptor,
    CUDAGraphMode,
    GraphSupport,
    get_forward_context,
    set_forward_context,
)
from cudagraph_manager import StaticInput

from .reference import DecoderConfig, ReferenceDecoder, request_lengths, rotary_cos_sin

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

#: Step inputs of ``PagedDecoder.forward``, in order.
PAGED_INPUT_NAMES: Final[tuple[str, ...]] = (
    "input_ids",
    "positions",
    "slot_mapping",
    "req_ids",
    "block_table",
    "seq_lens",
)
#: The block mask's query tile: it lists the pages each tile of this many query rows reads. Small,
#: so that a packed tile of decode tokens reads few requests' pages.
_Q_TILE: Final = 16
#: FlexAttention's kernel on CUDA: the general kernel with 16-row query and 64-key blocks. Measured
#: on an H100 (attention alone, graph replays, 16 heads of 64, pages of 128): decode of 256
#: requests 97 us against 1217 us with the defaults under dynamic shapes (flex decoding) and
#: 131 us with static shapes; a packed 512-token mixed batch 42 us against 174 us.
_KEY_BLOCK: Final = 64
_KERNEL_OPTIONS: Final[dict[str, bool | int]] = {
    "FORCE_USE_FLEX_ATTENTION": True,
    "BLOCK_M": _Q_TILE,
    "BLOCK_N": _KEY_BLOCK,
}
#: How often the compiled FlexAttention may specialize (shapes, layouts) before dynamo gives up.
_RECOMPILE_LIMIT: Final = 32
#: The request of a padding token: no request owns the scratch page.
PAD_REQUEST: Final = -1


@dataclasses.dataclass(frozen=True, slots=True)
class PagedLayout:
    """How each layer's KV cache is paged: ``[2, num_pages, page_size, heads, head_dim]``.

    ``num_pages`` includes the scratch page (page 0) that padding uses, so
    padding's values do not depend on how many pages the cache has;
    ``pages_per_seq`` is the block table's width, enough for ``max_seq_len``.
    """

    page_size: int
    num_pages: int
    pages_per_seq: int

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "pages_per_seq"):
            value: object = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if self.num_pages < 2:
            raise ValueError(
                f"num_pages: expected at least one page besides the scratch page, got {self.num_pages}"
            )

    #: The page that padding reads and writes.
    scratch_page: ClassVar[int] = 0

    @classmethod
    def for_config(
        cls, config: DecoderConfig, *, page_size: int = 128, num_pages: int | None = None
    ) -> PagedLayout:
        """Pages of ``page_size`` tokens; by default every request at ``max_seq_len``, and scratch."""
        given: object = page_size
        if not isinstance(given, int) or isinstance(given, bool) or given < 1:
            raise ValueError(f"page_size: expected an integer >= 1, got {page_size!r}")
        pages_per_seq = -(-config.max_seq_len // page_size)
        if num_pages is None:
            num_pages = config.max_num_seqs * pages_per_seq + 1
        return cls(page_size, num_pages, pages_per_seq)


class PagedStep(NamedTuple):
    """The step's paging inputs, and the page ownership derived from them (built once per step)."""

    positions: torch.Tensor  # [T] int64
    req_ids: torch.Tensor  # [T] int64: the token's row of block_table, PAD_REQUEST for padding
    block_table: torch.Tensor  # [R, pages_per_seq] int32
    seq_lens: torch.Tensor  # [R] int32
    owner: torch.Tensor  # [num_pages] int64: the request that owns each page, PAD_REQUEST if none
    page_index: torch.Tensor  # [num_pages] int64: the page's place in its owner's block-table row
    slot_page: torch.Tensor  # [num_pages * page_size] int32: each slot's page (a constant of the cache)
    #: Tokens per request of a uniform batch (every request has this many, in order), else None.
    query_len: int | None


def paged_step(
    layout: PagedLayout,
    positions: torch.Tensor,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_len: int | None = None,
    slot_page: torch.Tensor | None = None,
) -> PagedStep:
    """Page ownership from the block table, with capturable ops (scatters, no host sync).

    Only the entries a request uses (``i * page_size < seq_len``) claim a
    page; the rest of a row is ignored, whatever it holds. The scratch page
    belongs to no request, at index 0, so padding tokens read its first slot.
    The uniform query length comes from the forward context's key (the
    manager sets it for captures, replays and eager steps).
    """
    num_reqs, width = block_table.shape
    device = block_table.device
    columns = torch.arange(width, device=device)  # [M]
    used = columns[None, :] * layout.page_size < seq_lens[:, None]  # [R, M]
    # Unused entries scatter into one extra, dropped element.
    target = torch.where(used, block_table.long(), layout.num_pages)  # [R, M]
    owner = torch.full((layout.num_pages + 1,), PAD_REQUEST, dtype=torch.int64, device=device)
    owner.scatter_(0, target.flatten(), torch.arange(num_reqs, device=device).repeat_interleave(width))
    page_index = torch.zeros(layout.num_pages + 1, dtype=torch.int64, device=device)
    page_index.scatter_(0, target.flatten(), columns.repeat(num_reqs))
    # Fills of a slice, which a capture records (a setitem of a Python number would copy from
    # the host).
    scratch = slice(layout.scratch_page, layout.scratch_page + 1)
    owner, page_index = owner[: layout.num_pages], page_index[: layout.num_pages]
    owner[scratch].fill_(PAD_REQUEST)
    page_index[scratch].fill_(0)
    return PagedStep(
        positions,
        req_ids,
        block_table,
        seq_lens,
        owner,
        page_index,
        slot_pages(layout, device) if slot_page is None else slot_page,
        _uniform_query_len(positions, num_reqs) if query_len is None else query_len or None,
    )


def slot_pages(layout: PagedLayout, device: torch.device | str | None) -> torch.Tensor:
    """``[num_pages * page_size]`` int32: the page of every slot of the cache.

    The FlexAttention mask reads a key's page from this table: inductor 2.11
    failed to generate the division of a key index by the page size inside
    the kernel. ``PagedDecoder`` keeps one beside its caches.
    """
    slots = torch.arange(layout.num_pages * layout.page_size, dtype=torch.int32, device=device)
    return slots.div_(layout.page_size, rounding_mode="floor")  # in place: no second table cached


def _uniform_query_len(positions: torch.Tensor, num_reqs: int) -> int | None:
    """The key's tokens per request when the forward context says the batch is uniform."""
    context = get_forward_context()
    key = context.batch_descriptor if context is not None else None
    if key is None or not key.uniform or not key.num_reqs or key.num_reqs != num_reqs:
        return None
    num_tokens = positions.shape[0]
    return num_tokens // num_reqs if num_tokens % num_reqs == 0 else None


def token_pages(layout: PagedLayout, step: PagedStep) -> torch.Tensor:
    """``[T, pages_per_seq]``: each token's pages up to its position, the scratch page elsewhere."""
    width = step.block_table.shape[1]
    rows = step.block_table[step.req_ids.clamp(min=0)].long()  # [T, M]
    columns = torch.arange(width, device=rows.device)  # [M]
    visible = (step.req_ids >= 0)[:, None] & (columns[None, :] * layout.page_size <= step.positions[:, None])
    return torch.where(visible, rows, layout.scratch_page)


class PagedAttention(Protocol):
    """An attention backend over a paged cache: its per-step metadata, and the op the layers call.

    ``prepare`` runs once per step inside the forward (capturable ops only);
    ``attend`` writes the step's K/V into ``kv_cache`` at ``slot_mapping``
    and the attention into ``out``. ``support`` is what a FULL graph of it
    can replay (``AttentionSupport``); ``name`` names it in reports.
    """

    @property
    def support(self) -> AttentionSupport: ...

    def prepare(self, step: PagedStep) -> object: ...

    @property
    def attend(self) -> Callable[..., None]:
        """``attend(q, k, v, kv_cache, slot_mapping, metadata, out)``; q, k, v, out ``[T, heads, dim]``."""
        ...


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the step's ``k, v [T, heads, head_dim]`` at their slots (idempotent for the same step)."""
    heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = kv_cache.view(2, -1, heads, head_dim)  # [2, num_pages * page_size, heads, head_dim]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


class _PagedBackend:
    """What every backend here shares: write the step's K/V, then ``read`` the attention into ``out``.

    ``attend`` is an eager break (``breakable``): a PIECEWISE capture runs it
    between segments; a FULL capture records it inline.
    """

    def __init__(self, layout: PagedLayout, support: AttentionSupport, *, breakable: bool) -> None:
        self.layout: Final = layout
        self.support: Final = support
        self.attend: Final[Callable[..., None]] = (
            eager_break_during_capture(self._attend) if breakable else self._attend
        )

    def read(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: object) -> torch.Tensor:
        """The attention of ``q [T, heads, head_dim]`` over the cache, ``[T, heads, head_dim]``."""
        raise NotImplementedError

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        metadata: object,
        out: torch.Tensor,
    ) -> None:
        write_kv(kv_cache, slot_mapping, k, v)
        out.copy_(self.read(q, kv_cache, metadata))


class FlexPagedAttention(_PagedBackend):
    """torch's FlexAttention over the pages, its block mask built in the graph from the static inputs.

    Uniform batches (the forward context's key is uniform) attend as
    ``[R, heads, q, head_dim]`` queries, one batch row per request, whose
    block-mask row is the request's block table: each request reads its own
    pages and nothing else (the decode kernel). Other batches attend as one
    packed sequence of ``T`` queries; each tile of 16 queries reads the
    union of its requests' pages, and the mask keeps each token to its own
    request's keys up to its position. Both are built from fixed-shape
    tensors, so a FULL graph serves any batch: ``ALWAYS``.

    The page size must be a multiple of 64 on CUDA (the kernel's key
    block); ``compile`` (default: on CUDA) runs the fused Triton kernels,
    eager FlexAttention being a slow reference for CPU tests. A PIECEWISE
    capture runs ``attend`` eagerly between segments (``breakable``).
    ``traced=True``: the model is compiled whole by the caller
    (``torch.compile(mode="reduce-overhead")``), which compiles the attention
    with the same kernel options.
    """

    def __init__(
        self,
        layout: PagedLayout,
        *,
        compile: bool | None = None,
        breakable: bool = True,
        traced: bool = False,
    ) -> None:
        support = AttentionSupport(GraphSupport.ALWAYS, piecewise=breakable, name="flex_attention")
        super().__init__(layout, support, breakable=breakable)
        self._compile: Final = compile
        # Filled on first use (eager: a warm-up), and for ``traced`` here: dynamo warns about (and
        # sees through) the cache of paged_flex, so a trace must find the function in this dict.
        self._flex: Final[dict[bool, Callable[..., torch.Tensor]]] = (
            {False: paged_flex(layout.page_size, compiled=False, fused=True)} if traced else {}
        )
        self._traced: Final = traced

    def prepare(self, step: PagedStep) -> object:
        # Nothing here is sized by the cache's page count: a graph's metadata costs the same
        # whatever pages the cache has (``examples.kv_sizing`` sizes it after estimating).
        layout = self.layout
        num_tokens, page_size = step.positions.shape[0], layout.page_size
        query_len = step.query_len
        if query_len is not None:  # one batch row per request: its block-table row, its used pages
            num_reqs = step.block_table.shape[0]
            tiles = -(-query_len // _Q_TILE)
            counts = (step.seq_lens.clamp(min=1) + page_size - 1) // page_size  # [R]
            kv_num_blocks = counts.int()[:, None, None].expand(num_reqs, 1, tiles)  # [R, 1, tiles]
            kv_indices = step.block_table[:, None, None, :].expand(num_reqs, 1, tiles, -1)  # [R, 1, tiles, M]
        else:  # one packed sequence: each query tile reads the union of its tokens' pages
            kv_num_blocks, kv_indices = tile_unions(token_pages(layout, step), layout.scratch_page)
        rows = (-1, query_len) if query_len is not None else (1, num_tokens)
        pages = torch.arange(step.owner.shape[0], device=step.owner.device)  # [num_pages]
        return _FlexMetadata(
            kv_num_blocks.contiguous(),
            kv_indices.contiguous(),
            step.owner,
            (step.page_index - pages) * page_size,  # a key's position is this (of its page) + its slot
            step.slot_page,
            step.req_ids.view(rows),  # [B, Q]
            step.positions.view(rows),  # [B, Q]
            query_len,
        )

    def read(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: object) -> torch.Tensor:
        meta = cast(_FlexMetadata, metadata)
        num_tokens, heads, head_dim = q.shape
        keys = kv_cache[0].view(1, -1, heads, head_dim).transpose(1, 2)  # [1, heads, pages * page, head_dim]
        values = kv_cache[1].view(1, -1, heads, head_dim).transpose(1, 2)
        if meta.query_len is None:
            queries = q.transpose(0, 1)[None]  # [1, heads, T, head_dim]
        else:
            queries = q.view(-1, meta.query_len, heads, head_dim).transpose(1, 2)  # [R, heads, q, head_dim]
        # traced: an enclosing torch.compile (reduce-overhead) compiles the plain function, fused.
        compiled = not self._traced and (self._compile if self._compile is not None else q.is_cuda)
        attend = self._flex.get(compiled)
        if attend is None:
            attend = self._flex[compiled] = paged_flex(self.layout.page_size, compiled=compiled)
        result = attend(queries, keys, values, *meta[:-1])  # [B, heads, Q, head_dim]
        return result.transpose(1, 2).reshape(num_tokens, heads, head_dim)


def tile_unions(pages: torch.Tensor, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query tile's distinct pages, first, and how many: ``[1, 1, tiles]``, ``[1, 1, tiles, 16 * M]``.

    ``pages [T, M]`` are the tokens' pages. Sorted per tile, a page equal to
    the one before it is a repeat; repeats are moved to the end (sorted
    again under a key past every page) and not counted. Fixed shapes, no
    host sync: the width is the tile's tokens times their pages, never the
    cache's page count.
    """
    num_tokens, width = pages.shape
    tiles = -(-num_tokens // _Q_TILE)
    padded = torch.full((tiles * _Q_TILE, width), scratch, dtype=pages.dtype, device=pages.device)
    padded[:num_tokens] = pages
    ordered = padded.view(tiles, _Q_TILE * width).sort(dim=-1).values  # [tiles, 16 * M]
    repeat = torch.cat(
        (torch.zeros_like(ordered[:, :1], dtype=torch.bool), ordered[:, 1:] == ordered[:, :-1]), -1
    )
    past = torch.iinfo(torch.int32).max
    distinct = torch.where(repeat, past, ordered).sort(dim=-1).values  # [tiles, 16 * M]: distinct, then past
    kv_indices = torch.where(distinct == past, scratch, distinct).int()
    kv_num_blocks = (~repeat).sum(-1, dtype=torch.int32)
    return kv_num_blocks[None, None], kv_indices[None, None]


class _FlexMetadata(NamedTuple):
    kv_num_blocks: torch.Tensor  # [B, 1, tiles] int32: pages each query tile reads
    kv_indices: torch.Tensor  # [B, 1, tiles, width] int32: which (the first kv_num_blocks)
    owner: torch.Tensor  # [num_pages] int64: PagedStep's
    page_shift: torch.Tensor  # [num_pages] int64: a slot's position in its request, minus the slot
    slot_page: torch.Tensor  # [num_pages * page_size] int32: PagedStep's
    query_req: torch.Tensor  # [B, Q]: each query's request
    query_pos: torch.Tensor  # [B, Q]: each query's position
    query_len: int | None  # uniform: [R, H, q, D] queries; None: one packed [1, H, T, D] sequence


@functools.cache
def paged_flex(page_size: int, *, compiled: bool, fused: bool | None = None) -> Callable[..., torch.Tensor]:
    """FlexAttention over pages of ``page_size``: ``f(queries, keys, values, *_FlexMetadata[:-1])``.

    ``queries [B, heads, Q, head_dim]``; ``keys``, ``values [1, heads, S,
    head_dim]`` (every slot of every page); query ``(b, q)`` is the token of
    request ``query_req[b, q]`` at ``query_pos[b, q]``, and it sees the keys
    of its request's pages at positions up to its own. The block mask is
    made inside the function from tensors only, so one compiled function
    (``compiled``: ``torch.compile``, dynamic shapes) serves every step; a
    mask closure made outside would be a new object per step for the
    compiler to guard on. ``fused`` (default: ``compiled``) passes the
    fused kernel's options, for a caller whose own ``torch.compile`` traces
    this function.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def attend(
        queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *metadata: torch.Tensor
    ) -> torch.Tensor:
        # metadata: kv_num_blocks, kv_indices, owner, page_shift, slot_page, query_req, query_pos
        block_mask = _block_mask(BlockMask, page_size, (queries.shape[2], keys.shape[2]), *metadata)
        scale = queries.shape[-1] ** -0.5
        options = _KERNEL_OPTIONS if (compiled if fused is None else fused) else None
        return flex_attention(
            queries,
            keys,
            values,
            block_mask=block_mask,
            scale=scale,
            kernel_options=options,  # type: ignore[arg-type]  # a TypedDict in torch's stubs
        )

    if (compiled if fused is None else fused) and page_size % _KEY_BLOCK:
        raise ValueError(
            f"page_size: FlexAttention's kernel reads keys in blocks of {_KEY_BLOCK}, "
            f"so pages hold a multiple of it; got {page_size}"
        )
    if not compiled:
        return attend
    compiled_attend = torch.compile(attend, fullgraph=True, dynamic=True)

    def attend_compiled(*args: torch.Tensor) -> torch.Tensor:
        # Up to 8 specializations are expected (packed or per request; 1, under 128 or more
        # queries; one request or more), which meets dynamo's default limit of 8.
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            return compiled_attend(*args)

    return attend_compiled


def _block_mask(
    mask_type: type[BlockMask],
    page_size: int,
    seq_lengths: tuple[int, int],
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    owner: torch.Tensor,
    page_shift: torch.Tensor,
    slot_page: torch.Tensor,
    query_req: torch.Tensor,
    query_pos: torch.Tensor,
) -> BlockMask:
    """The step's block mask, from tensors only (``paged_flex``): each query sees its request's past.

    ``mask_type`` is torch's ``BlockMask``, imported by the caller (this module imports it lazily).
    """

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        # Table look-ups and one addition: no arithmetic of kv_idx with a constant (the
        # division by the page size failed to generate in inductor 2.11).
        page = slot_page[kv_idx]
        same_request = owner[page] == query_req[b, q_idx]
        return same_request & (page_shift[page] + kv_idx <= query_pos[b, q_idx])

    return mask_type.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        BLOCK_SIZE=(_Q_TILE, page_size),
        mask_mod=visible,
        seq_lengths=seq_lengths,
        compute_q_blocks=False,
    )


class _GatherMetadata(NamedTuple):
    pages: torch.Tensor  # [T, pages_per_seq] int64: each token's pages, scratch beyond its position
    mask: torch.Tensor  # [T, 1, 1, pages_per_seq * page_size] additive


class GatherPagedAttention(_PagedBackend):
    """Each token's pages gathered whole, then SDPA with a mask: the toy attention, on pages.

    Fixed shapes throughout (every token reads ``pages_per_seq`` pages), so
    a FULL graph serves any batch: ``ALWAYS``. It runs anywhere torch runs.
    """

    def __init__(self, layout: PagedLayout, dtype: torch.dtype, *, breakable: bool = True) -> None:
        support = AttentionSupport(GraphSupport.ALWAYS, piecewise=breakable, name="gather_sdpa")
        super().__init__(layout, support, breakable=breakable)
        self.dtype: Final = dtype  # the mask's: SDPA adds it as is

    def prepare(self, step: PagedStep) -> object:
        layout = self.layout
        pages = token_pages(layout, step)  # [T, M]
        span = pages.shape[1] * layout.page_size
        logical = torch.arange(span, device=pages.device)  # [M * page]
        hidden = logical[None, :] > step.positions[:, None]  # [T, M * page]
        mask = hidden.to(self.dtype).mul_(torch.finfo(self.dtype).min)
        return _GatherMetadata(pages, mask[:, None, None, :])

    def read(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: object) -> torch.Tensor:
        meta = cast(_GatherMetadata, metadata)
        num_tokens, heads, head_dim = q.shape
        rows = kv_cache[:, meta.pages]  # [2, T, M, page, heads, head_dim]
        rows = rows.view(2, num_tokens, -1, heads, head_dim).transpose(
            2, 3
        )  # [2, T, heads, M * page, head_dim]
        result = F.scaled_dot_product_attention(
            q.unsqueeze(2), rows[0], rows[1], attn_mask=meta.mask
        )  # [T, heads, 1, head_dim]
        return result.squeeze(2)


#: The backends by name (``--attention`` of the demo and the benchmarks).
BACKENDS: Final = ("flex", "gather")


class PagedDecoder(nn.Module):
    """The reference decoder's weights over a paged KV cache, attending through ``backend``.

    ``forward(input_ids, positions, slot_mapping, req_ids, block_table,
    seq_lens) -> [T, hidden]`` (module docstring: shapes and padding).
    ``backend``: ``"flex"`` (``FlexPagedAttention``), ``"gather"``
    (``GatherPagedAttention``) or a ``PagedAttention``; ``breakable=False``
    records the attention inline in every capture (no PIECEWISE split).
    ``graph_support()`` is what the manager resolves its mode against.
    """

    slot_page: torch.Tensor

    def __init__(
        self,
        config: DecoderConfig,
        *,
        layout: PagedLayout | None = None,
        backend: str | PagedAttention = "flex",
        device: torch.device | str | None = None,
        breakable: bool = True,
    ) -> None:
        super().__init__()
        self.config: Final = config
        #: The cache's paging; ``allocate_kv_cache`` changes its page count.
        self.layout = PagedLayout.for_config(config) if layout is None else layout
        if isinstance(backend, str):
            backend = make_backend(backend, self.layout, config.dtype, breakable=breakable)
        self.backend: PagedAttention = backend
        shape = (2, self.layout.num_pages, self.layout.page_size, config.num_heads, config.head_dim)
        #: Weights, rotary table and the per-layer caches (``[2, pages, page_size, heads, head_dim]``).
        self.body: Final = ReferenceDecoder(config, device=device, kv_cache_shape=shape)
        # Each slot's page (``slot_pages``), kept with the caches: the FlexAttention mask reads it.
        self.register_buffer("slot_page", slot_pages(self.layout, self.body.embed.device), persistent=False)

    def graph_support(self) -> AttentionSupport:
        """What FULL graphs of this model can replay: its attention backend's support."""
        return self.backend.support

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        req_ids: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        query_len: int | None = None,
    ) -> torch.Tensor:
        """One step -> final hidden states ``[T, hidden]``; attention metadata built once for all layers.

        ``query_len``: every request has this many tokens (a uniform batch),
        0 for any batch; by default the forward context's key says (tracers
        that cannot read it pass it here).
        """
        body, backend = self.body, self.backend
        step = paged_step(self.layout, positions, req_ids, block_table, seq_lens, query_len, self.slot_page)
        metadata = backend.prepare(step)
        cos, sin = rotary_cos_sin(positions, body.rotary, self.config.num_heads)
        x = F.embedding(input_ids, body.embed)  # [T, hidden]
        for layer in body.decoder_layers:
            q, k, v = layer.project(x, cos, sin)
            attn = torch.empty_like(q)
            backend.attend(q, k, v, layer.kv_cache, slot_mapping, metadata, attn)
            x = layer.finish(x, attn)
        return body.final(x)

    def step(self, inputs: dict[str, torch.Tensor], *, uniform_decode: bool = False) -> torch.Tensor:
        """``forward`` on a dict of step inputs (``make_paged_inputs``), typed.

        ``uniform_decode``: the batch is uniform (every request has the same
        number of tokens), said through the forward context as the manager
        says it, so the attention lays it out per request.
        """
        if not uniform_decode:
            return self.forward(*(inputs[name] for name in PAGED_INPUT_NAMES))
        num_tokens, num_reqs = inputs["positions"].shape[0], inputs["seq_lens"].shape[0]
        with set_forward_context(CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, True)):
            return self.forward(*(inputs[name] for name in PAGED_INPUT_NAMES))

    def with_backend(self, backend: PagedAttention) -> PagedDecoder:
        """This model attending through ``backend``: the same weights and caches, shared, not copied."""
        twin = copy.copy(self)
        twin.backend = backend
        return twin

    def kv_caches(self) -> list[torch.Tensor]:
        """Every layer's paged cache, ``[2, pages, page_size, heads, head_dim]``: the mutable state."""
        return [layer.kv_cache for layer in self.body.decoder_layers]

    def warm_up(self, max_tokens: int, *, query_len: int = 1) -> None:
        """Run each shape class the attention specializes on once, on padding (an engine's warm-up).

        FlexAttention is compiled with dynamic shapes but specializes on
        sizes 1 and 2, on multiples of its 16-query tile, and on the layout
        (packed or per request): one step of each, up to ``max_tokens``
        tokens, compiles them all before memory is profiled, estimated or
        captured, so none compiles later inside a capture. Only the scratch
        page is written.
        """
        for name, value in (("max_tokens", max_tokens), ("query_len", query_len)):
            given: object = value
            if not isinstance(given, int) or isinstance(given, bool) or given < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        pads = paged_static_inputs(self.layout)
        device = self.body.embed.device
        max_reqs = min(self.config.max_num_seqs, max_tokens // query_len)
        packed = sorted({n for n in (1, 2, 16, 17, max_tokens) if n <= max_tokens})
        uniform = sorted({r for r in (1, 2, 16, 17, max_reqs) if 1 <= r <= max_reqs})
        # Layouts said, never read from a forward context the caller may have set: 0 is packed.
        steps = [(n, n, 0) for n in packed] + [(r * query_len, r, query_len) for r in uniform]
        with torch.no_grad():
            for num_tokens, num_reqs, q in steps:
                inputs = {
                    name: torch.full(
                        (num_reqs if spec.rows == "reqs" else num_tokens, *spec.shape),
                        spec.pad_value,
                        dtype=spec.dtype,
                        device=device,
                    )
                    for name, spec in pads.items()
                }
                self.forward(*(inputs[name] for name in PAGED_INPUT_NAMES), query_len=q)

    def kv_page_bytes(self) -> int:
        """The bytes of one page (its keys and values over all layers, its slots' page table)."""
        config, layout = self.config, self.layout
        per_layer = 2 * layout.page_size * config.num_heads * config.head_dim * config.dtype.itemsize
        return config.num_layers * per_layer + layout.page_size * torch.int32.itemsize

    def allocate_kv_cache(self, num_pages: int) -> None:
        """Give every layer a cache of ``num_pages`` pages (scratch included), freeing the old ones first.

        One uninitialized allocation for all layers, as an engine sizes its
        cache from the memory left (``examples.kv_sizing``). The static
        inputs' padding does not change (the scratch page is page 0). Call it
        before capturing: graphs read the caches at their addresses.
        """
        config = self.config
        given: object = num_pages
        if not isinstance(given, int) or isinstance(given, bool) or given < 2:
            raise ValueError(
                f"num_pages: expected an integer >= 2 (a page and the scratch page), got {num_pages!r}"
            )
        device = self.body.embed.device
        for layer in self.body.decoder_layers:  # the old caches go first: the new one may need their memory
            layer.kv_cache = torch.empty(0, device=device, dtype=config.dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.slot_page = torch.empty(0, dtype=torch.int32, device=device)
        self.layout = dataclasses.replace(self.layout, num_pages=num_pages)
        self.slot_page = slot_pages(self.layout, device)
        shape = (config.num_layers, 2, num_pages, self.layout.page_size, config.num_heads, config.head_dim)
        caches = torch.empty(shape, device=device, dtype=config.dtype)
        for layer, cache in zip(self.body.decoder_layers, caches.unbind(0), strict=True):
            layer.kv_cache = cache


def make_backend(
    name: str, layout: PagedLayout, dtype: torch.dtype, *, breakable: bool = True
) -> PagedAttention:
    """The backend called ``name`` (``BACKENDS``)."""
    if name == "flex":
        return FlexPagedAttention(layout, breakable=breakable)
    if name == "gather":
        return GatherPagedAttention(layout, dtype, breakable=breakable)
    raise ValueError(f"backend: expected one of {list(BACKENDS)} or a PagedAttention, got {name!r}")


def paged_static_inputs(layout: PagedLayout) -> dict[str, StaticInput]:
    """``PagedDecoder``'s inputs for ``CUDAGraphManager``: four token rows and two request rows.

    Padding tokens write and read the scratch page's first slot as request
    ``PAD_REQUEST``; padding requests' block-table rows are the scratch page,
    one token long.
    """
    scratch_slot = layout.scratch_page * layout.page_size
    return {
        "input_ids": StaticInput(dtype=torch.int64, rows="tokens", pad_value=0),
        "positions": StaticInput(dtype=torch.int64, rows="tokens", pad_value=0),
        "slot_mapping": StaticInput(dtype=torch.int64, rows="tokens", pad_value=scratch_slot),
        "req_ids": StaticInput(dtype=torch.int64, rows="tokens", pad_value=PAD_REQUEST),
        "block_table": StaticInput(
            shape=(layout.pages_per_seq,), dtype=torch.int32, rows="reqs", pad_value=layout.scratch_page
        ),
        "seq_lens": StaticInput(dtype=torch.int32, rows="reqs", pad_value=1),
    }


def make_paged_inputs(
    config: DecoderConfig,
    layout: PagedLayout,
    num_tokens: int,
    *,
    uniform_decode: bool,
    query_len: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Random inputs of one step on a randomly paged cache (``PAGED_INPUT_NAMES``).

    Requests as ``make_step_inputs`` draws them (``query_len`` tokens each
    when ``uniform_decode``), each at a random place in its sequence, its
    pages drawn without replacement from a shuffled pool; the block-table
    entries past a request's length hold random pages, which the attention
    must ignore. Drawn on the CPU with ``generator``, then moved to ``device``.
    """
    g = generator
    lengths = request_lengths(
        config, num_tokens, uniform_decode=uniform_decode, query_len=query_len, generator=g
    )
    page_size, width = layout.page_size, layout.pages_per_seq
    ends = [
        int(torch.randint(length, config.max_seq_len + 1, (), generator=g)) for length in lengths
    ]  # seq_lens: the request's context after this step
    needed = sum(-(-end // page_size) for end in ends)
    if needed > layout.num_pages - 1:
        raise ValueError(f"num_tokens: this step needs {needed} pages, the cache has {layout.num_pages - 1}")
    pool = (torch.randperm(layout.num_pages - 1, generator=g) + 1).tolist()  # every page but scratch
    table = torch.randint(1, layout.num_pages, (len(lengths), width), generator=g, dtype=torch.int32)
    positions: list[torch.Tensor] = []
    for r, (length, end) in enumerate(zip(lengths, ends, strict=True)):
        used = -(-end // page_size)
        table[r, :used] = torch.tensor(pool[:used], dtype=torch.int32)
        del pool[:used]
        positions.append(torch.arange(end - length, end))
    position = torch.cat(positions)  # [T]
    req_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [T]
    pages = table[req_ids, position // page_size].long()  # [T]
    return {
        "input_ids": torch.randint(0, config.vocab_size, (num_tokens,), generator=g).to(device),
        "positions": position.to(device),
        "slot_mapping": (pages * page_size + position % page_size).to(device),
        "req_ids": req_ids.to(device),
        "block_table": table.to(device),  # [R, pages_per_seq]
        "seq_lens": torch.tensor(ends, dtype=torch.int32).to(device),  # [R]
    }


def dense_reference(model: PagedDecoder, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The step computed without paging tricks: each request's keys gathered in order, SDPA per request.

    An oracle for tests (slow: a Python loop over requests, in float64 attention).
    """
    return model.with_backend(_PerRequestAttention(model.layout)).step(inputs)


class _PerRequestAttention(_PagedBackend):
    """Attention one request at a time over its logical keys, in float64: the tests' oracle."""

    def __init__(self, layout: PagedLayout) -> None:
        support = AttentionSupport(GraphSupport.NEVER, piecewise=False, name="per_request")
        super().__init__(layout, support, breakable=False)

    def prepare(self, step: PagedStep) -> object:
        return step

    def read(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: object) -> torch.Tensor:
        step = cast(PagedStep, metadata)
        page_size, scratch = self.layout.page_size, self.layout.scratch_page
        out = torch.empty_like(q)
        for t in range(q.shape[0]):
            r, position = int(step.req_ids[t]), int(step.positions[t])
            pages = (
                step.block_table[r].long() if r >= 0 else torch.full_like(step.block_table[0].long(), scratch)
            )
            logical = torch.arange(position + 1, device=q.device)
            slots = pages[logical // page_size] * page_size + logical % page_size  # [position + 1]
            keys = kv_cache[0].flatten(0, 1)[slots].double()  # [L, heads, head_dim]
            values = kv_cache[1].flatten(0, 1)[slots].double()
            scores = torch.einsum("hd,lhd->hl", q[t].double(), keys) * q.shape[-1] ** -0.5
            out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values).to(out.dtype)
        return out
