"""FlashAttention's variable-length kernel as torch's C++ op: what ``varlen_attn`` runs, less its wrapper.

``torch.nn.attention.varlen.varlen_attn`` (torch 2.11 to 2.13) is a Python
custom op around ``aten::_flash_attention_forward``. A custom op's first
call imports ``torch._dynamo`` (``torch._compile._disable_dynamo``), and
with it sympy and inductor: seconds in a fresh process, paid by whichever
step runs attention first (a capture's first warm-up). The op itself is
C++ and imports nothing, so the examples call it directly, with the
arguments ``varlen_attn`` gives it (no dropout, the default scale, no
softmax statistics kept), and drop the ``rng_state`` fill the wrapper adds.

The op reads a paged cache (``seqused_k`` and ``block_table``) where the
installed ``varlen_attn`` takes them (torch >= 2.12, ``PAGED_FLASH``),
since it passes them on; elsewhere they are refused by name.
"""

from __future__ import annotations

import inspect
from typing import Final

import torch
from torch.nn.attention import varlen

_OP: Final = torch.ops.aten._flash_attention_forward.default
#: Whether the installed kernel reads a paged cache (``block_table`` with ``seqused_k``).
PAGED_FLASH: Final = {"block_table", "seqused_k"} <= set(inspect.signature(varlen.varlen_attn).parameters)
#: The dtypes FlashAttention computes in.
FLASH_DTYPES: Final = (torch.float16, torch.bfloat16)


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T_q, heads, head_dim]``: ``varlen_attn(q, k, v, ...)`` on CUDA, half precision.

    ``q [T_q, heads, head_dim]``; ``k``, ``v [T_k, heads, head_dim]`` packed
    (or ``[pages, page_size, heads, head_dim]`` with ``block_table [R, M]``
    and ``seqused_k [R]``, ``cu_seq_k`` then ``None``); ``cu_seq_q``,
    ``cu_seq_k [R + 1]`` int32. ``causal``: the last query on the last key
    (bottom-right, as FlashAttention aligns unequal lengths).
    """
    if q.dtype not in FLASH_DTYPES:
        raise ValueError(f"q: FlashAttention computes in float16 or bfloat16, got {q.dtype}")
    paged = {
        name: value
        for name, value in (("seqused_k", seqused_k), ("block_table", block_table))
        if value is not None
    }
    if paged and not PAGED_FLASH:
        raise ValueError(f"{sorted(paged)}: FlashAttention of torch {torch.__version__} reads no paged cache")
    output: torch.Tensor = _OP(
        q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, causal, False, scale=None, **paged
    )[0]
    return output
