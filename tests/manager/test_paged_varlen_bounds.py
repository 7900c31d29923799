"""The varlen backend's work follows the real batch in a mixed key: bounds, padding and the packed keys.

A mixed key's padding requests hold no query and its padding tokens' rows
are zeros, so the query bound is a request's longest context
(``max_seq_len``), not the key's token count; the gathered path packs only
the rows below the real key total (``row_gather``: Triton on CUDA). CPU
tests run the stand-in; GPU tests the kernels, in a graph refilled between
replays.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from cudagraph_manager.attention import BatchShape, metadata_extra
from examples.paged.layout import PagedLayout
from examples.paged.row_gather import TRITON, gather_rows
from examples.paged.varlen import VarlenPagedAttention
from tests.manager.test_paged_kernels import HEAD_DIM, HEADS, _cuda_steps, graph_errors, oracle, random_step
from tests.torch_support import highest_fp32_matmul_precision, rel_err

M: Final = CUDAGraphMode
#: Contexts of at most 32 keys, a mixed key of 64 tokens: the padding request would hold more.
LAYOUT: Final = PagedLayout(16, num_pages=120, pages_per_seq=2)


def test_varlen_mixed_key_bounds_queries_by_a_context_and_zeros_the_padding_rows() -> None:
    backend = VarlenPagedAttention(LAYOUT, max_tokens=64, max_reqs=8, paged=False)
    step = random_step(LAYOUT, (7, 1, 1, 11, 1), seed=5)
    shape = BatchShape(64, 8, None, M.FULL)  # 43 padding tokens, 3 padding requests
    meta = backend.build(step.batch(), shape)
    assert meta.max_q == LAYOUT.max_seq_len  # not the key's 64 tokens
    assert meta.cu_seq_q.tolist() == [0, 7, 8, 9, 20, 21, 21, 21, 21]  # padding requests: no query
    assert meta.paged.query_start_loc.tolist()[-1] == 64  # the shared metadata is as it was
    pad = 64 - 21
    q = torch.cat((step.q, torch.randn(pad, HEADS, HEAD_DIM)))
    k, v = (torch.cat((t, t.new_zeros(pad, HEADS, HEAD_DIM))) for t in (step.k, step.v))
    slots = torch.cat((step.inputs["slot_mapping"], torch.zeros(pad, dtype=torch.int64)))
    out = torch.full_like(q, float("nan"))
    with (
        set_forward_context(M.FULL, BatchDescriptor(64, 8), **metadata_extra(backend, meta)),
        highest_fp32_matmul_precision(),
    ):
        backend.attend(q, k, v, step.kv_cache, slots, out)
    assert rel_err(out[:21], oracle(step)) < 1e-5
    assert out[21:].abs().max() == 0  # padding rows: zeros, no NaN


def test_varlen_uniform_key_keeps_its_offsets_and_bound() -> None:
    backend = VarlenPagedAttention(LAYOUT, max_tokens=64, max_reqs=8, paged=False)
    meta = backend.build(random_step(LAYOUT, (1,) * 5, seed=6).batch(), BatchShape(8, 8, 1, M.FULL))
    assert meta.max_q == 1
    assert meta.cu_seq_q.data_ptr() == meta.paged.query_start_loc.data_ptr()


def test_gather_rows_packs_the_rows_below_the_total() -> None:
    kv_cache = torch.randn(2, 6, 4, HEADS, HEAD_DIM)
    slots = torch.tensor([5, 17, 3, 3, 0, 0])
    packed = gather_rows(kv_cache, slots, torch.tensor([4], dtype=torch.int32))
    flat = kv_cache.view(2, -1, HEADS, HEAD_DIM)
    assert torch.equal(packed[:, :4], flat[:, slots[:4]])


@pytest.mark.gpu
def test_gather_rows_on_cuda_in_a_graph_stops_at_the_total() -> None:
    cuda = torch.device("cuda")
    kv_cache = torch.randn(2, 40, 16, HEADS, HEAD_DIM, device=cuda, dtype=torch.bfloat16)
    slots = torch.randint(0, 640, (96,), device=cuda)
    total = torch.tensor([50], dtype=torch.int32, device=cuda)
    gather_rows(kv_cache, slots, total)  # compiles the kernel, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed = gather_rows(kv_cache, slots, total)
    flat = kv_cache.view(2, -1, HEADS, HEAD_DIM)
    for end in (50, 96, 1, 0):
        total.fill_(end)
        slots.copy_(torch.randint(0, 640, (96,), device=cuda))
        packed.fill_(float("nan"))
        graph.replay()
        assert torch.equal(packed[:, :end], flat[:, slots[:end]])
        if TRITON:  # the rows past the total are not written
            assert packed[:, end:].isnan().all()


@pytest.mark.gpu
def test_varlen_full_graph_of_a_mixed_key_longer_than_a_context_replays_any_batch_on_cuda() -> None:
    shape = BatchShape(96, 8, None, M.FULL)  # up to 95 padding tokens over contexts of at most 32 keys
    mixes = ((7, 1, 1, 12, 1, 3), (29,), (1, 1, 1, 1, 1), (5, 16, 2, 1, 1, 1, 9), (1,) * 8)
    backend = VarlenPagedAttention(LAYOUT, max_tokens=96, max_reqs=8, device="cuda", paged=False)
    errors = graph_errors(backend, shape, _cuda_steps(LAYOUT, mixes))  # no NaN, padding rows included
    assert max(errors) < 2e-2, errors
