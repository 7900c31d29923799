"""FlexAttention's kernel over the pages: the block mask made from tensors, one compiled function.

``paged_flex(page_size, compiled=...)`` is what ``FlexPagedAttention`` calls
with the step's queries, the cache's keys and values and the block mask's
inputs (``flex``'s ``_FlexPlan``); the mask is made inside it, so one
compiled function serves every step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

#: The block mask's query tile: it lists the pages each tile of this many query rows reads. Small,
#: so that a packed tile of decode tokens reads few requests' pages.
Q_TILE: Final = 16
#: FlexAttention's kernel on CUDA: the general kernel with 16-row query and 64-key blocks, forced
#: because it beat the defaults (flex decoding under dynamic shapes, and static shapes) for decode
#: and packed mixed batches alike (the figures: ``docs/benchmarks-notes.md``). The key block
#: is why pages hold a multiple of 64 keys on CUDA: a block-mask entry is one page, and the
#: fused kernel requires the mask's key block to be a multiple of its own (``BLOCK_N``). A
#: smaller ``BLOCK_N`` for small pages is possible but unmeasured; pages of 16 are served by
#: ``gather``, ``varlen`` and ``split_decode``.
KEY_BLOCK: Final = 64
_KERNEL_OPTIONS: Final[dict[str, bool | int]] = {
    "FORCE_USE_FLEX_ATTENTION": True,
    "BLOCK_M": Q_TILE,
    "BLOCK_N": KEY_BLOCK,
}
#: How often the compiled FlexAttention may specialize (shapes, layouts) before dynamo gives up.
_RECOMPILE_LIMIT: Final = 32
#: Whether dynamo gives equal sizes one symbol (its default); off here (``paged_flex``). A switch
#: for the benchmarks' A/B of the compile classes (``tests/benchmarks/defaults.py``), not an option.
DUCK_SHAPE = False
#: Queries of a packed step at which the compiled kernel's code changes (inductor's flex lowering
#: guards on a query length under 128, where it would consider its decoding kernel).
SHORT_QUERIES: Final = 128
#: FlexAttention's generated Triton kernel (torch 2.11 to 2.13) computes a key's element offset as
#: ``offs_n * stride_kn`` in 32 bits (pytorch/pytorch#185264): keys that span 2**31 elements or more
#: are read from the wrong address (a fault, or silently wrong attention; vLLM #50427 refuses them too).
MAX_KEY_ELEMENTS: Final = 2**31


def addressable_slots(slot_stride: int) -> int:
    """The most key slots the fused kernel addresses when one slot's key is ``slot_stride`` elements on."""
    return MAX_KEY_ELEMENTS // slot_stride


def compile_class(num_tokens: int, num_reqs: int, query_len: int | None) -> tuple[object, ...]:
    """Which compiled code of ``paged_flex`` a step of these counts runs: steps of one class share it.

    The compile marks every size dynamic and gives every dimension a symbol
    of its own (no duck sizing, which made a size that happened to equal
    another dimension, 16 queries and 16 heads, compile on its own). What
    still specializes: a dimension of 1 (dynamo's 0/1 rule: one query, one
    request row, one query tile), a packed step's query count under
    ``SHORT_QUERIES`` (a guard of inductor's lowering), the layout (packed or
    one row per request) and the queries per request. 2 tokens and the
    multiples of the query tile (16) and of 128, which specialized before
    duck sizing was turned off, are classes of their own too: a spare warm-up
    costs an eager step, a class missed a compile inside a recording (which
    the manager then records again after a warm-up).
    """
    if query_len is not None:  # one batch row per request: [R, heads, q, head_dim], q fixed per class
        return ("uniform", query_len, min(num_reqs, 2), query_len <= Q_TILE)
    return (
        "packed",
        min(num_tokens, 3),  # 1, 2, more
        num_tokens <= Q_TILE,  # one query tile
        num_tokens < SHORT_QUERIES,
        num_tokens % Q_TILE == 0,
        num_tokens % SHORT_QUERIES == 0,
    )


@functools.cache
def paged_flex(page_size: int, *, compiled: bool) -> Callable[..., torch.Tensor]:
    """FlexAttention over pages of ``page_size``: ``f(queries, keys, values, *_FlexPlan)``.

    ``queries [B, heads, Q, head_dim]``; ``keys``, ``values [1, heads, S,
    head_dim]`` (every slot of every page); query ``(b, q)`` is the token of
    request ``query_req[b, q]`` at ``query_pos[b, q]``, and it sees the keys
    of its request's pages at positions up to its own. The block mask is
    made inside the function from tensors only, so one compiled function
    (``compiled``: ``torch.compile``, dynamic shapes, the fused kernel's
    options) serves every step; a mask closure made outside would be a new
    object per step for the compiler to guard on.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def attend(
        queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *metadata: torch.Tensor
    ) -> torch.Tensor:
        block_mask = _block_mask(BlockMask, page_size, (queries.shape[2], keys.shape[2]), *metadata)
        return flex_attention(
            queries,
            keys,
            values,
            block_mask=block_mask,
            scale=queries.shape[-1] ** -0.5,
            kernel_options=_KERNEL_OPTIONS if compiled else None,  # type: ignore[arg-type]  # a TypedDict in torch's stubs
        )

    if not compiled:
        return attend
    from torch.fx.experimental import _config as fx_config

    compiled_attend = torch.compile(attend, fullgraph=True, dynamic=True)

    def attend_compiled(*args: torch.Tensor) -> torch.Tensor:
        # A handful of specializations are expected (``compile_class``), near dynamo's default
        # limit of 8. Each dimension gets a symbol of its own (no duck sizing): a size equal to
        # another dimension's must not specialize (16 queries and 16 heads, 32 query tiles and
        # 32 block-table columns did, each one more compile).
        with (
            torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT),
            fx_config.patch(use_duck_shape=DUCK_SHAPE),  # type: ignore[attr-defined]  # installed at import
        ):
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
    page_of_slot: torch.Tensor,
    query_req: torch.Tensor,
    query_pos: torch.Tensor,
) -> BlockMask:
    """The step's block mask, from tensors only (``paged_flex``): each query sees its request's past.

    ``mask_type`` is torch's ``BlockMask``, imported by the caller (this module imports it lazily).
    """

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        # Table look-ups and one addition: no arithmetic of kv_idx with a constant (the
        # division by the page size failed to generate in inductor 2.11).
        page = page_of_slot[kv_idx]
        same_request = owner[page] == query_req[b, q_idx]
        return same_request & (page_shift[page] + kv_idx <= query_pos[b, q_idx])

    return mask_type.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        BLOCK_SIZE=(Q_TILE, page_size),
        mask_mod=visible,
        seq_lengths=seq_lengths,
        compute_q_blocks=False,
    )
