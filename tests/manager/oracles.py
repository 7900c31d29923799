"""The float64 oracle of the paged backends: a step computed one token at a time, without paging tricks.

- ``dense_reference``: a ``PagedDecoder`` step through ``PerRequestAttention``.
- ``PerRequestAttention``: a ``PagedBackend`` that no graph may hold.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import torch

from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager.attention import BatchShape, StepBatch, attention_metadata
from examples.paged import EagerBreakAttention, PagedBuffers, PagedDecoder, PagedLayout, PagedMetadata


def dense_reference(
    model: PagedDecoder, inputs: dict[str, torch.Tensor], *, uniform_decode: bool = False
) -> torch.Tensor:
    """The step computed without paging tricks: each token's keys gathered in order, float64 attention.

    An oracle for tests (slow: a Python loop over tokens). Same weights and
    caches as ``model``; the cache is written as ``model`` would write it.
    """
    num_tokens, num_reqs = inputs["input_ids"].shape[0], inputs["query_lens"].shape[0]
    oracle = PerRequestAttention(
        model.layout, max_tokens=num_tokens, max_reqs=num_reqs, device=model.body.device
    )
    return model.with_backend(oracle).step(inputs, uniform_decode=uniform_decode)


@dataclasses.dataclass(frozen=True, slots=True)
class _OracleMetadata:
    paged: PagedMetadata


class PerRequestAttention(EagerBreakAttention):
    """Attention one token at a time over its request's logical keys, in float64: the tests' oracle.

    A ``PagedBackend`` that no graph may hold (``NEVER``, no PIECEWISE split).
    """

    support: Final = AttentionSupport(GraphSupport.NEVER, piecewise=False, name="per_request")

    def __init__(
        self, layout: PagedLayout, *, max_tokens: int, max_reqs: int, device: torch.device | str | None
    ) -> None:
        super().__init__(breakable=False)
        self.layout: Final = layout
        self.buffers: Final = PagedBuffers(layout, max_tokens, max_reqs, device)

    def build(self, batch: StepBatch, shape: BatchShape, /) -> _OracleMetadata:
        return _OracleMetadata(self.buffers.fill(batch, shape))

    def build_for_capture(self, shape: BatchShape, /) -> _OracleMetadata:
        return _OracleMetadata(self.buffers.views(shape))

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        meta = attention_metadata(self).paged
        page_size, scratch = self.layout.page_size, self.layout.scratch_page
        keys_all, values_all = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)  # [slots, heads, dim]
        for t in range(q.shape[0]):
            r, position = int(meta.req_ids[t]), int(meta.positions[t])
            row = meta.block_table[max(r, 0)].long()
            pages = row if r >= 0 else torch.full_like(row, scratch)
            logical = torch.arange(position + 1, device=q.device)
            slots = pages[logical // page_size] * page_size + logical % page_size  # [position + 1]
            keys, values = keys_all[slots].double(), values_all[slots].double()  # [L, heads, head_dim]
            scores = torch.einsum("hd,lhd->hl", q[t].double(), keys) * q.shape[-1] ** -0.5
            out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values).to(out.dtype)
