"""The kernel calls of the varlen backend: FlashAttention's varlen kernel over the pages, and its stand-in.

The kernel is torch's ``varlen_attn``'s, called as its C++ op
(``examples.flash_varlen`` says why). ``varlen_attn(q, k, v, cu_seq_q,
cu_seq_k, max_q, max_k)`` attends packed
requests: request ``r`` has queries ``cu_seq_q[r]:cu_seq_q[r + 1]`` and keys
``cu_seq_k[r]:cu_seq_k[r + 1]``, causal with the last query on the last key
(bottom-right, as FlashAttention aligns ``q_len != k_len``). Its host values
are bounds (``max_q``, ``max_k``), its offsets tensors (``varlen`` says why
that lets one FULL graph serve any batch of its key).

How the kernel reads the keys depends on the installed torch:

- paged (torch >= 2.12: the kernel takes ``block_table`` and
  ``seqused_k``): the kernel reads each request's pages through its
  block-table row, ``seq_lens`` keys of them;
- gathered (torch 2.11, whose kernel takes neither): the keys are
  gathered into a packed buffer of ``num_reqs * max_k`` rows first. Packed
  row ``j`` belongs to request ``r = searchsorted(cu_seq_k, j)`` at offset
  ``j - cu_seq_k[r]``, a slot through its block-table row; rows past the
  total read the scratch slot. Fixed shapes, no host sync: capturable. Only
  the rows below the real total are copied where Triton runs
  (``row_gather``): the gather's traffic follows the batch, not the bound.

The kernel runs on CUDA only, in float16 or bfloat16. Elsewhere a
per-request stand-in with the same arguments runs (``varlen_stand_in``), so
CPU tests cover the metadata; it reads the offsets on the host (not
capturable). Padding requests have one key and may have many queries: their
first rows see no key and come out as zeros, as FlashAttention leaves them;
rows are independent, so nothing of them reaches a real row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from ..flash_varlen import PAGED_FLASH, flash_varlen
from .row_gather import gather_rows

#: Whether the installed FlashAttention reads a paged cache (``block_table`` and ``seqused_k``).
PAGED_VARLEN: Final = PAGED_FLASH
#: The slot that padding reads: the scratch page's first.
_SCRATCH_SLOT: Final = 0  # PagedLayout.scratch_page * page_size, page 0 being the scratch page


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """``[R + 1]`` int32 offsets of ``lengths [R]``: 0, then their running sums (device ops)."""
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def gathered_key_slots(
    seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int, max_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered path's key offsets and the cache slot of every packed key row.

    ``seq_lens [R]`` int32, ``block_table [R, pages_per_seq]`` int32.
    Returns ``cu_seq_k [R + 1]`` int32 (cumulative ``seq_lens``) and
    ``slots [R * max_k]`` int64: packed row ``j`` is key ``j - cu_seq_k[r]``
    of request ``r``, read at its page's slot; rows past the total read the
    scratch slot. Fixed shapes, device ops only (capturable).
    """
    num_reqs, width = block_table.shape
    cu_seq_k = cumulative(seq_lens)  # [R + 1]
    rows = torch.arange(num_reqs * max_k, device=seq_lens.device)  # [R * max_k]
    ends = cu_seq_k[1:].long()  # [R]
    req = torch.searchsorted(ends, rows, right=True).clamp_(max=num_reqs - 1)  # [R * max_k]
    offset = rows - cu_seq_k[req]  # [R * max_k]: the key's position in its request
    column = torch.div(offset, page_size, rounding_mode="floor").clamp_(0, width - 1)
    page = block_table[req, column].long()  # [R * max_k]
    used = (offset >= 0) & (offset < seq_lens[req])
    slots = torch.where(used, page * page_size + offset % page_size, _SCRATCH_SLOT)
    return cu_seq_k, slots


def varlen_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    paged: bool | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` over each request's pages, ``[T, heads, head_dim]``.

    ``q [T, heads, head_dim]``; ``kv_cache [2, num_pages, page_size, heads,
    head_dim]``; ``query_start_loc [R + 1]`` int32 (its last the total
    ``T``); ``seq_lens [R]`` int32 (a request's keys, this step's
    included); ``block_table [R, pages_per_seq]`` int32; ``max_q``,
    ``max_k`` bound the query and key lengths. ``paged``: read the pages
    through the block table (default: where the kernel can).
    """
    page_size = kv_cache.shape[2]
    if paged if paged is not None else PAGED_VARLEN:
        return paged_varlen(q, kv_cache, query_start_loc, seq_lens, block_table, max_q, max_k)
    cu_seq_k, slots = gathered_key_slots(seq_lens, block_table, page_size, max_k)
    return gathered_varlen(q, kv_cache, query_start_loc, cu_seq_k, slots, max_q, max_k)


def paged_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seq_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """The paged path (``varlen_paged_attention``'s arguments): the kernel reads the block table."""
    if not PAGED_VARLEN:
        raise RuntimeError(
            f"FlashAttention of torch {torch.__version__} takes no block_table: use the gathered path"
        )
    keys, values = kv_cache[0], kv_cache[1]  # [num_pages, page_size, heads, head_dim]
    extra = {"seqused_k": seq_lens, "block_table": block_table}
    return _varlen(q, keys, values, cu_seq_q, None, max_q, max_k, extra)


def gathered_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    slots: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """The gathered path: the keys at ``slots`` (``gathered_key_slots``) packed, then the kernel.

    Only the rows below ``cu_seq_k[-1]`` are packed where ``row_gather`` can
    stop there; the kernel reads no row past it.
    """
    packed = gather_rows(kv_cache, slots, cu_seq_k[-1:])  # [2, R * max_k, heads, head_dim]
    return _varlen(q, packed[0], packed[1], cu_seq_q, cu_seq_k, max_q, max_k, {})


def _varlen(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    extra: Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """FlashAttention on CUDA (``flash_varlen``), the stand-in elsewhere; causal, the default scale."""
    if not q.is_cuda:
        return varlen_stand_in(q, keys, values, cu_seq_q, cu_seq_k, max_q, max_k, **extra)
    return flash_varlen(q, keys, values, cu_seq_q, cu_seq_k, max_q, max_k, causal=True, **extra)


def varlen_stand_in(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal ``varlen_attn`` one request at a time with SDPA: its arguments, its zeros, any device.

    Packed keys (``cu_seq_k``) or pages (``block_table`` with
    ``seqused_k``: ``keys [num_pages, page_size, heads, head_dim]``). Reads
    the offsets on the host, and checks the bounds the kernel trusts: a
    request longer than ``max_q`` or ``max_k`` raises ``ValueError``.
    """
    starts = cu_seq_q.tolist()
    lengths = seqused_k if cu_seq_k is None else cu_seq_k[1:] - cu_seq_k[:-1]
    if lengths is None:
        raise ValueError("cu_seq_k: needed without seqused_k (the keys' lengths)")
    ends = lengths.tolist()
    out = torch.zeros_like(q)
    for r, key_len in enumerate(ends):
        q_len = starts[r + 1] - starts[r]
        if q_len > max_q or key_len > max_k:
            raise ValueError(
                f"request {r}: {q_len} queries over {key_len} keys exceed max_q={max_q}, max_k={max_k}"
            )
        if q_len == 0:
            continue
        if block_table is None:
            assert cu_seq_k is not None
            first = int(cu_seq_k[r])
            k, v = keys[first : first + key_len], values[first : first + key_len]
        else:
            pages = block_table[r].long()
            k = keys[pages].flatten(0, 1)[:key_len]  # [key_len, heads, head_dim]
            v = values[pages].flatten(0, 1)[:key_len]
        out[starts[r] : starts[r + 1]] = causal_rows(q[starts[r] : starts[r + 1]], k, v, key_len)
    return out


def causal_rows(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor | int
) -> torch.Tensor:
    """One request's causal attention, bottom-right aligned: ``[n, heads, head_dim]`` in ``q``'s dtype.

    ``q [n, heads, head_dim]`` are the last ``n`` of ``length`` positions;
    ``keys``, ``values [S, heads, head_dim]`` (``S >= length``) hold the
    request's keys first (the rest is hidden). Query ``i`` sees keys up to
    ``i + length - n``; a row that sees none is zeros. ``length`` may be a
    device value: no host sync.
    """
    n = q.shape[0]
    device = q.device
    column = torch.arange(keys.shape[0], device=device)[None, :]  # [1, S]
    last = torch.arange(n, device=device)[:, None] + (length - n)  # [n, 1]: each query's position
    visible = (column <= last) & (column < length)  # [n, S]
    result = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible
    )  # [heads, n, head_dim]
    return torch.where(visible.any(-1)[:, None, None], result.transpose(0, 1), 0.0)
