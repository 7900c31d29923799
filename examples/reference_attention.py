"""The reference decoder's attention: its per-step metadata, ``cached_attention`` and the op forms of it.

- ``build_attention_metadata``: ``AttentionMetadata`` of one step (mask,
  cache indices, rotary cos/sin), with capturable ops only.
- ``cached_attention``: write the step's K/V into the cache, attend over each
  request's cache row into a caller-provided buffer.
- ``AttentionOp``: what a layer calls; ``breakable_cached_attention`` (an
  eager break) and ``traced_cached_attention`` (a ``torch.library`` custom
  op, registered when this module is imported) are two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, NamedTuple, TypeAlias

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import Tensor

from cudagraph_capture import eager_break_during_capture

from .body import rotary_cos_sin


class AttentionMetadata(NamedTuple):
    """Per-step attention metadata, built once per step (``ReferenceDecoder.metadata``).

    A NamedTuple rather than a dataclass so that tracers (torch.compile) see
    through it without a graph break.
    """

    cache_rows: torch.Tensor  # [T] int64: the cache row of each token
    key_index: torch.Tensor  # [T] int64: the token's key row in the flat cache (see ``cached_attention``)
    value_index: torch.Tensor  # [T] int64: its value row, ``key_index + max_seq_len`` (once per step)
    mask: torch.Tensor  # [T, 1, 1, max_seq_len] additive: 0 where key j <= position, else dtype's min
    cos: torch.Tensor  # [T, 2, heads, head_dim]: cos of each rotary angle, for q and k
    sin: torch.Tensor  # [T, 2, heads, head_dim]: sin, negated on the first half (see ``body.rotate``)


def build_attention_metadata(
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    key_positions: torch.Tensor,
    rotary: torch.Tensor,
    num_heads: int,
) -> AttentionMetadata:
    """The metadata of one step, with capturable ops only (no host sync).

    ``positions`` and ``cache_rows`` are ``[T]``; ``key_positions`` is
    ``arange(max_seq_len)``; ``rotary`` is ``rotary_table``'s
    ``[max_seq_len, 2, head_dim]``; cos and sin come from ``rotary_cos_sin``.
    """
    max_seq_len = key_positions.shape[0]
    dtype = rotary.dtype
    hidden = key_positions[None, :] > positions[:, None]  # [T, L]
    # Additive, in the model's dtype: SDPA adds it as is, where a boolean mask
    # would be converted again in every layer. The dtype's min, not -inf: a
    # row is never fully masked (key 0 is always visible), but min stays finite.
    mask = hidden.to(dtype).mul_(torch.finfo(dtype).min)  # [T, L]
    key_index = cache_rows * (2 * max_seq_len) + positions  # [T]: row (cache row, 0, position)
    cos, sin = rotary_cos_sin(positions, rotary, num_heads)
    return AttentionMetadata(
        cache_rows=cache_rows,
        key_index=key_index,
        value_index=key_index + max_seq_len,
        mask=mask[:, None, None, :],
        cos=cos,
        sin=sin,
    )


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    key_index: torch.Tensor,
    value_index: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write this step's K/V into the cache, attend, write the result to ``out``.

    Shapes: ``q``, ``k``, ``v`` and ``out`` are ``[T, heads, head_dim]``;
    ``kv_cache`` is ``[max_num_seqs + 1, 2, max_seq_len, heads, head_dim]``
    (per request row: its keys, then its values); ``cache_rows``,
    ``key_index`` and ``value_index`` (rows of the cache flattened to
    ``[-1, heads, head_dim]``) are ``[T]``; ``mask`` is
    ``[T, 1, 1, max_seq_len]``. Token ``t`` attends over its request's cache
    row at positions ``<= positions[t]``, which include the keys this step
    writes (a prefill chunk is causal within itself).

    Fixed shapes throughout (the gather reads whole cache rows), so it is
    capturable; the write is idempotent for the same inputs.
    """
    num_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    flat = kv_cache.view(-1, num_heads, head_dim)  # [rows * 2 * max_seq_len, heads, head_dim]
    flat.index_copy_(0, key_index, k)
    flat.index_copy_(0, value_index, v)
    # Keys and values of the step's requests in one advanced-index gather
    # along the leading axis: the fastest layout and gather at 1 to 128 tokens.
    rows = kv_cache[cache_rows].transpose(2, 3)  # [T, 2, heads, L, head_dim]
    result = F.scaled_dot_product_attention(
        q.unsqueeze(2), rows[:, 0], rows[:, 1], attn_mask=mask
    )  # [T, heads, 1, head_dim]
    out.copy_(result.squeeze(2))


#: The attention a layer calls: ``cached_attention``'s arguments, passed
#: positionally in its order (``q, k, v, kv_cache, cache_rows, key_index,
#: value_index, mask, out``), and its effects: it writes the step's K/V into
#: ``kv_cache`` and the attention into ``out``, and returns nothing.
#: ``breakable_cached_attention`` and ``traced_cached_attention`` are
#: ``cached_attention`` behind a break point and as a tracer's op; another
#: engine's break decorator around it is one too. A callable type rather
#: than a Protocol restating ``cached_attention``'s signature: the op is
#: called positionally, so parameter names would add nothing to the type.
AttentionOp: TypeAlias = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], None
]


#: The attention op as an eager break: a breakable (PIECEWISE) capture runs it
#: between graph segments, a FULL capture records it like any other code.
breakable_cached_attention: Final = eager_break_during_capture(cached_attention)


#: ``cached_attention`` as one opaque op for tracers (``torch.compile``),
#: declared as writing the cache and ``out`` in place, as engines register
#: their attention. Traced as plain code instead, its in-place writes into the
#: cache (a graph input) would make the compiled step as slow as eager.
traced_cached_attention: Final = torch.library.custom_op(
    "cudagraph_manager::cached_attention", cached_attention, mutates_args=("kv_cache", "out")
)


@traced_cached_attention.register_fake
def _no_outputs(*args: torch.Tensor) -> None:
    """The op's shape function for tracing: it returns nothing, only writes its arguments."""
