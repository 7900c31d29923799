"""FlashAttention's variable-length kernel as torch's C++ op: what ``varlen_attn`` runs, less its wrapper.

``torch.nn.attention.varlen.varlen_attn`` (torch 2.11 to 2.13) is a Python
custom op around ``aten::_flash_attention_forward``. A custom op's first
call imports ``torch._dynamo`` (``torch._compile._disable_dynamo``), and
with it sympy and inductor: seconds in a fresh process, paid by whichever
step runs attention first (a capture's first warm-up). The op itself is
C++ and imports nothing, so the examples call it directly, with the
arguments ``varlen_attn`` gives it (no dropout, the default scale, no
softmax statistics kept), and drop the ``rng_state`` fill the wrapper adds.

The op's keywords differ by release (``seqused_k`` and ``block_table``
since 2.12): ``PAGED_FLASH`` says whether the installed one reads a paged
cache, and a keyword it lacks is refused by name.
"""

from __future__ import annotations

from typing import Final

import torch

_OP: Final = torch.ops.aten._flash_attention_forward.default
#: The installed op's keyword-only parameters (its schema).
_KEYWORDS: Final = frozenset(a.name for a in _OP._schema.arguments if a.kwarg_only)
#: Whether the installed op reads a paged cache (``block_table`` with ``seqused_k``).
PAGED_FLASH: Final = {"block_table", "seqused_k"} <= _KEYWORDS
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
    **paged: torch.Tensor,
) -> torch.Tensor:
    """``[T_q, heads, head_dim]``: ``varlen_attn(q, k, v, ...)`` on CUDA, half precision.

    ``q [T_q, heads, head_dim]``; ``k``, ``v [T_k, heads, head_dim]`` packed
    (or ``[pages, page_size, heads, head_dim]`` with ``block_table`` and
    ``seqused_k`` in ``paged``, ``cu_seq_k`` then ``None``);
    ``cu_seq_q``, ``cu_seq_k [R + 1]`` int32. ``causal``: the last query
    on the last key (bottom-right, as FlashAttention aligns unequal lengths).
    """
    if q.dtype not in FLASH_DTYPES:
        raise ValueError(f"q: FlashAttention computes in float16 or bfloat16, got {q.dtype}")
    unknown = sorted(set(paged) - _KEYWORDS)
    if unknown:
        raise ValueError(f"{unknown}: FlashAttention of torch {torch.__version__} takes no such argument")
    output: torch.Tensor = _OP(
        q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, causal, False, scale=None, **paged
    )[0]
    return output
