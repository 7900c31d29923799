"""FlexAttention's packed layout split over batch rows (``FlexPagedAttention(split=True)``).

A mixed key of decode size has few query tiles, each walking the union of
its 16 tokens' pages in series; ``split`` cuts each tile's pages into rows
combined by their log-sum-exp (docs/benchmarks-notes.md, "FlexAttention's
mixed key at decode sizes"). CPU tests check the cut, the combination and
the backend against the oracle (eager FlexAttention masks with ``mask_mod``
alone, so only a GPU runs the chunks as the kernel reads them).
"""

from __future__ import annotations

from typing import Any, Final, cast

import pytest
import torch

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from cudagraph_manager.attention import BatchShape, metadata_extra
from examples.paged.flex import FlexPagedAttention, split_count, split_tiles
from examples.paged.flex_kernel import combine_splits
from examples.paged.layout import PagedLayout
from tests.manager.test_paged_kernels import HEAD_DIM, HEADS, _cuda_steps, graph_errors, oracle, random_step
from tests.torch_support import eager_flex_is_expected as eager_flex_is_expected  # autouse
from tests.torch_support import highest_fp32_matmul_precision, rel_err

M: Final = CUDAGraphMode


def test_split_tiles_puts_each_page_of_a_tile_in_one_row() -> None:
    counts = torch.tensor([[[3, 1]]], dtype=torch.int32)  # [1, 1, tiles]
    indices = torch.tensor([[[[5, 7, 9, 0], [4, 0, 0, 0]]]], dtype=torch.int32)  # [1, 1, tiles, 4]
    split_counts, split_indices = split_tiles(counts, indices, 2, scratch=0)
    assert split_counts.tolist() == [[[2, 1]], [[1, 0]]]  # [S, 1, tiles]
    assert split_indices.tolist() == [[[[5, 7], [4, 0]]], [[[9, 0], [0, 0]]]]  # [S, 1, tiles, 2]
    three = split_tiles(counts, indices, 3, scratch=0)  # a chunk width that does not divide: padded
    assert three[0].tolist() == [[[2, 1]], [[1, 0]], [[0, 0]]]


@pytest.mark.parametrize(
    ("num_tokens", "pages_per_seq", "splits"),
    [(1, 1, 1), (2, 1, 1), (4, 1, 2), (16, 1, 8), (64, 1, 2), (256, 1, 1), (512, 1, 1), (1, 4, 2)],
)
def test_split_count_fills_few_tiles_and_leaves_many_alone(
    num_tokens: int, pages_per_seq: int, splits: int
) -> None:
    assert split_count(num_tokens, pages_per_seq) == splits


def test_combine_splits_is_the_softmax_over_every_key() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(HEADS, 5, HEAD_DIM, generator=g) for _ in range(3))  # 5 queries, 5 keys
    hidden = torch.tensor([[True, True, False, False, False]] * 4 + [[True] * 5])  # query 4 sees nothing
    scores = torch.einsum("hqd,hkd->hqk", q, k).masked_fill(hidden, float("-inf"))
    parts, lses = [], []
    for keys in (slice(0, 2), slice(2, 5)):  # the first chunk's keys are hidden from queries 0-3
        s = scores[..., keys]
        lse = s.logsumexp(-1)  # [heads, Q]
        parts.append(torch.nan_to_num(torch.softmax(s, -1)) @ v[:, keys])
        lses.append(lse)
    combined = combine_splits(torch.stack(parts), torch.stack(lses))[0]  # [heads, Q, head_dim]
    expected = torch.nan_to_num(torch.softmax(scores, -1)) @ v
    assert rel_err(combined, expected) < 1e-5
    assert combined[:, 4].abs().max() == 0  # a query that sees no key: zeros


@pytest.mark.parametrize("query_lens", [(1,) * 6, (1,) * 16, (5, 1, 1, 2)])
def test_split_backend_equals_the_oracle_on_the_cpu(query_lens: tuple[int, ...]) -> None:
    layout = PagedLayout(16, num_pages=120, pages_per_seq=5)
    backend = FlexPagedAttention(layout, max_tokens=16, max_reqs=16, compile=False, split=True)
    step = random_step(layout, query_lens, seed=len(query_lens))
    shape = BatchShape(16, 16, None, M.FULL)  # a mixed key of decode size: split_count(16, 5) rows
    meta = backend.build(step.batch(), shape)
    real, pad = step.q.shape[0], 16 - step.q.shape[0]
    q, k, v = (torch.cat((t, t.new_zeros(pad, HEADS, HEAD_DIM))) for t in (step.q, step.k, step.v))
    slots = torch.cat((step.inputs["slot_mapping"], torch.zeros(pad, dtype=torch.int64)))
    out = torch.full_like(q, float("nan"))
    with (
        set_forward_context(M.FULL, BatchDescriptor(16, 16), **metadata_extra(backend, meta)),
        highest_fp32_matmul_precision(),
    ):
        backend.attend(q, k, v, step.kv_cache, slots, out)
    assert rel_err(out[:real], oracle(step)) < 1e-5
    assert not out.isnan().any()


def test_split_is_checked_where_the_backend_is_built() -> None:
    with pytest.raises(ValueError, match="split"):
        FlexPagedAttention(PagedLayout(16, 8, 1), max_tokens=4, max_reqs=4, compile=False, split="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [16, 64])
def test_split_compiled_kernel_in_a_graph_equals_the_oracle_on_cuda(num_tokens: int) -> None:
    """The fused kernel reads each row's chunk of pages: a page in no row or in two would show here."""
    layout = PagedLayout(64, num_pages=200, pages_per_seq=3)
    backend = FlexPagedAttention(
        layout, max_tokens=num_tokens, max_reqs=num_tokens, device="cuda", split=True
    )
    assert split_count(num_tokens, layout.pages_per_seq) > 1
    shape = BatchShape(num_tokens, num_tokens, None, M.FULL)
    mixes = ((1,) * num_tokens, (1,) * (num_tokens // 2), (5, 1, 1, 2), (9,) + (1,) * (num_tokens - 9))
    errors = graph_errors(cast(Any, backend), shape, _cuda_steps(layout, mixes))
    assert max(errors) < 2e-2, errors
