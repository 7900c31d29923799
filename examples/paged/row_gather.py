"""The gathered varlen path's key packing: rows up to a device total, the rest not touched.

``varlen_attn`` of torch 2.11 reads packed keys, so the gathered path packs
each request's keys first (``varlen_kernels.gathered_key_slots`` says which
slot each packed row reads). The packed buffer is sized for the shape's
bound (``num_reqs * max_k`` rows), but the attention reads only the rows
below ``cu_seq_k[-1]``, the batch's real total. ``gather_rows`` copies
those rows and leaves the others unwritten (the attention never reads
them), so its memory traffic follows the real lengths, not the bound: on
CUDA with Triton installed, one kernel whose programs past the total return
at once (``row_gather_triton``); elsewhere torch's indexing, which copies
every row (the scratch slot for those past the total).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Final

import torch

#: Whether Triton is installed (torch's CUDA builds ship it): the kernel that stops at the total.
TRITON: Final = importlib.util.find_spec("triton") is not None


def gather_rows(kv_cache: torch.Tensor, slots: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``[2, N, heads, head_dim]``: row ``j < total`` holds K/V at ``slots[j]``; the rest unspecified.

    ``kv_cache [2, num_pages, page_size, heads, head_dim]``; ``slots [N]``
    int64 (every entry in range, ``gathered_key_slots``'); ``total [1]``
    int32 on the device (``cu_seq_k[-1:]``). Fixed shapes, no host sync:
    capturable. On CUDA with Triton the rows past ``total`` are neither read
    nor written; elsewhere every row is copied.
    """
    heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = kv_cache.view(2, -1, heads, head_dim)  # [2, num_pages * page_size, heads, head_dim]
    if not (flat.is_cuda and TRITON):
        return flat[:, slots]
    return _triton_gather()(flat, slots, total)


@functools.cache
def _triton_gather() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The Triton kernel's launcher, imported on first use (Triton's import is not free)."""
    from .row_gather_triton import gather_rows_until

    return gather_rows_until
