"""FlashAttention over the pages through torch's ``varlen_attn``: one kernel for every batch.

``varlen_attn`` takes its host values as bounds (``max_q``, ``max_k``) and
its offsets as tensors, so with ``max_q`` chosen per key, one FULL graph
replays any batch of its key: ``VarlenPagedAttention`` declares ``ALWAYS``.
Its work follows the real batch, not the key's bound: in a mixed key the
padding requests hold no query (their offsets stop at the real total) and
the padding tokens' rows are zeros, so ``max_q`` is at most a request's
longest context (``max_seq_len``), not the key's token count, and the
kernel's programs of padding requests return at once; the gathered path
packs only the real keys (``row_gather``). It reads the pages through the
block table where the installed torch can, else gathers them first, its key
map derived from the metadata once per forward (the first layer's
attention: a FULL graph rebuilds it on every replay, and a decode loop that
moves or advances the requests' rows needs nothing else); the kernel calls,
and the stand-in that runs off CUDA, are ``varlen_kernels``.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager.attention import BatchShape, StepBatch, attention_metadata

from .base import EagerBreakAttention, per_forward
from .batch import PagedBuffers, PagedMetadata, Validate
from .layout import PagedLayout
from .varlen_kernels import PAGED_VARLEN, gathered_key_slots, gathered_varlen, paged_varlen


@dataclasses.dataclass(frozen=True, slots=True)
class VarlenMetadata:
    """``VarlenPagedAttention``'s metadata: the paged batch, its query offsets, the gathered path's key map.

    ``cu_seq_q``: the query offsets the kernel reads, ``paged.query_start_loc``
    but for a mixed shape's padding requests, which hold no query (their
    offsets are the real total); ``real``: which tokens are not padding (the
    others' rows come out as zeros). ``max_q``: the query bound, ``paged.max_query_len``
    capped for a mixed shape at ``paged.max_seq_len`` (a real request's
    queries are some of its keys). ``cu_seq_k``, ``key_slots``:
    ``gathered_key_slots`` of the batch, in buffers of the backend (``None``
    on the paged path), written by the forward that reads them (``derived``
    notes which forward did). The host bounds depend on the shape alone.
    """

    paged: PagedMetadata
    cu_seq_q: torch.Tensor  # [R + 1] int32
    real: torch.Tensor  # [T, 1, 1] bool
    max_q: int
    cu_seq_k: torch.Tensor | None  # [R + 1] int32
    key_slots: torch.Tensor | None  # [R * max_seq_len] int64
    derived: list[tuple[object, bool]] = dataclasses.field(default_factory=list, compare=False)


class VarlenPagedAttention(EagerBreakAttention):
    """FlashAttention (``varlen_attn``) over the pages: a ``PagedBackend`` whose FULL graphs serve any batch.

    Arguments:
        layout: the cache's paging (any page size).
        max_tokens, max_reqs: the largest batch; the buffers are sized once for it.
        device: where the buffers live; on CUDA the model computes in float16 or bfloat16.
        breakable: ``attend`` is an eager break, so PIECEWISE graphs split at it.
        paged: read the pages through the block table (default: where the installed
            ``varlen_attn`` takes one and, on CUDA, accepts this page size); ``False``: gathered.
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
        paged: bool | None = None,
        validate: Validate = True,
        page_limit: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(breakable=breakable)
        self.layout: Final = layout
        self.paged: Final = _choose_paged(paged, layout, device)
        name = "varlen_paged" if self.paged else "varlen_gathered"
        self.support: Final = AttentionSupport(GraphSupport.ALWAYS, piecewise=breakable, name=name)
        self.buffers: Final = PagedBuffers(
            layout,
            max_tokens,
            max_reqs,
            device,
            validate=validate,
            page_limit=page_limit,
            vocab_size=vocab_size,
        )
        self._cu_seq_q: Final = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self._real: Final = torch.zeros(max_tokens, 1, 1, dtype=torch.bool, device=device)
        self._zero: Final = torch.zeros((), device=device)  # the padding rows' value
        rows = 0 if self.paged else max_reqs
        self._cu_seq_k: Final = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self._key_slots: Final = torch.zeros(rows * layout.max_seq_len, dtype=torch.int64, device=device)
        self._views: Final[dict[BatchShape, VarlenMetadata]] = {}

    def build(self, batch: StepBatch, shape: BatchShape, /) -> VarlenMetadata:
        """``batch`` padded to ``shape`` (device ops); the gathered path's key map is the forward's."""
        meta = self._view(self.buffers.fill(batch, shape))
        if shape.query_len is None:  # mixed: padding requests hold no query, padding tokens are zeros
            offsets, real = meta.cu_seq_q, min(batch.num_reqs, shape.num_reqs)
            offsets.copy_(meta.paged.query_start_loc)
            offsets[real + 1 :].copy_(offsets[real].expand(shape.num_reqs - real))
            torch.ge(meta.paged.req_ids[:, None, None], 0, out=meta.real)
        return meta

    def build_for_capture(self, shape: BatchShape, /) -> VarlenMetadata:
        """The buffers of ``shape`` as they are (host only)."""
        return self._view(self.buffers.views(shape))

    def request_rows(self) -> tuple[torch.Tensor, ...]:
        """The metadata rows a shrinking decode loop moves with its requests (``PagedBuffers``')."""
        return self.buffers.request_rows()

    def _view(self, paged: PagedMetadata) -> VarlenMetadata:
        meta = self._views.get(paged.shape)
        if meta is None:
            shape = paged.shape
            num_reqs = shape.num_reqs
            cu_seq_k = None if self.paged else self._cu_seq_k[: num_reqs + 1]
            key_slots = None if self.paged else self._key_slots[: num_reqs * paged.max_seq_len]
            if shape.query_len is None:  # mixed: the backend's offsets, the bound of a request
                cu_seq_q, max_q = self._cu_seq_q[: num_reqs + 1], min(paged.max_query_len, paged.max_seq_len)
            else:  # uniform: every request, padding included, has query_len queries
                cu_seq_q, max_q = paged.query_start_loc, paged.max_query_len
            real = self._real[: shape.num_tokens]
            meta = VarlenMetadata(paged, cu_seq_q, real, max_q, cu_seq_k, key_slots)
            if paged.shape.mode is not CUDAGraphMode.NONE:  # graph shapes only: eager ones are many
                self._views[paged.shape] = meta
        return meta

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        self.attend_with(attention_metadata(self), q, kv_cache, out)

    def attend_with(
        self, meta: VarlenMetadata, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The attention of ``q`` over ``kv_cache`` into ``out`` (``[T, H, D]``) as ``meta`` says.

        ``_attend`` with the metadata given: a backend that composes this one
        (``split_decode``'s mixed batches) passes the metadata it got from
        ``build`` or ``build_for_capture``.
        """
        paged = meta.paged
        bounds = (meta.max_q, paged.max_seq_len)
        cu_seq_k, key_slots = meta.cu_seq_k, meta.key_slots
        if cu_seq_k is None or key_slots is None:
            result = paged_varlen(q, kv_cache, meta.cu_seq_q, paged.seq_lens, paged.block_table, *bounds)
        else:
            per_forward(meta.derived, lambda: self._key_map(paged, cu_seq_k, key_slots))
            result = gathered_varlen(q, kv_cache, meta.cu_seq_q, cu_seq_k, key_slots, *bounds)
        if paged.shape.query_len is None:  # mixed: the kernel left the padding tokens' rows unwritten
            torch.where(meta.real, result, self._zero, out=out)
        else:
            out.copy_(result)

    def _key_map(self, paged: PagedMetadata, cu_seq_k: torch.Tensor, key_slots: torch.Tensor) -> bool:
        """The gathered path's key map of ``paged``, into its buffers (device ops, once per forward)."""
        offsets, slots = gathered_key_slots(
            paged.seq_lens, paged.block_table, self.layout.page_size, paged.max_seq_len
        )
        cu_seq_k.copy_(offsets)
        key_slots.copy_(slots)
        return True


def _choose_paged(paged: bool | None, layout: PagedLayout, device: torch.device | str | None) -> bool:
    """The path: as asked (``ValueError`` where the installed torch cannot), else the paged where it runs."""
    if paged is not None:
        if paged and not PAGED_VARLEN:
            raise ValueError(f"paged: FlashAttention of torch {torch.__version__} takes no block_table")
        return paged
    if not PAGED_VARLEN:
        return False
    where = torch.empty(0, device=device).device
    return where.type != "cuda" or paged_kernel_accepts(layout.page_size, where)


def paged_kernel_accepts(page_size: int, device: torch.device) -> bool:
    """Whether FlashAttention on ``device`` reads pages of ``page_size`` (one tiny call, at start-up)."""
    dtype, head_dim = torch.bfloat16, 64
    q = torch.zeros(1, 1, head_dim, dtype=dtype, device=device)  # [T, heads, head_dim]
    kv_cache = torch.zeros(2, 2, page_size, 1, head_dim, dtype=dtype, device=device)
    cu_seq_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    block_table = torch.ones(1, 1, dtype=torch.int32, device=device)
    try:
        paged_varlen(q, kv_cache, cu_seq_q, seq_lens, block_table, 1, page_size)
    except RuntimeError:
        return False
    return True
