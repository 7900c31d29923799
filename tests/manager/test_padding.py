"""Padding of batch-dependent attention metadata, property-tested on the CPU.

``pad_offsets`` and ``pad_rows`` are the seam's helpers; ``PagedBuffers`` is
the paged example's metadata, padded to the shape a graph runs: the real
batch first, then padding requests that own the padding tokens (offsets end
at the padded total), one key each on the scratch page.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given

from cudagraph_dispatch import BatchDescriptor, CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch, pad_offsets, pad_rows
from examples import DecoderConfig
from examples.paged import GatherPagedAttention, PagedDecoder, paged_static_inputs
from examples.paged.batch import PAD_REQUEST, PagedBuffers, check_paged_batch
from examples.paged.layout import PagedLayout
from tests.manager.helpers import FakeEngines
from tests.manager.oracles import dense_reference
from tests.strategies import PagedStepCase, padded_query_lens, paged_steps
from tests.torch_support import rel_err


@given(padded_query_lens())
def test_padded_offsets_keep_the_real_ones_and_end_at_the_padded_total(
    case: tuple[list[int], int, int],
) -> None:
    lens, padded_reqs, padded_total = case
    real = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)  # [n + 1]
    out = torch.full((padded_reqs + 1,), -7, dtype=torch.int32)
    assert pad_offsets(out, real, padded_total) is out
    assert out[: len(lens) + 1].tolist() == real.tolist()
    # Each request's tokens: the real ones; the first padding request holds every padding token.
    padding = padded_reqs - len(lens)
    expected = [*lens, *([padded_total - sum(lens)] if padding else []), *[0] * max(padding - 1, 0)]
    assert out.diff().tolist() == expected
    assert int(out[-1]) == (padded_total if padding else sum(lens))


def test_padded_offsets_refuse_more_offsets_than_the_padded_batch() -> None:
    with pytest.raises(ValueError, match="offsets: expected between 1 and 3 rows"):
        pad_offsets(torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), 9)


@given(padded_query_lens())
def test_padded_rows_keep_the_real_ones_and_fill_the_rest(case: tuple[list[int], int, int]) -> None:
    lens, padded_reqs, _ = case
    out = torch.full((padded_reqs,), -7, dtype=torch.int32)
    pad_rows(out, torch.tensor(lens, dtype=torch.int32), 1)
    assert out.tolist() == [*lens, *[1] * (padded_reqs - len(lens))]


def test_padded_rows_refuse_more_rows_than_the_padded_batch() -> None:
    with pytest.raises(ValueError, match="rows: 3 rows do not fit the 2"):
        pad_rows(torch.zeros(2), torch.ones(3), 0)


def _inputs(step: PagedStepCase, layout: PagedLayout) -> dict[str, torch.Tensor]:
    query_lens, seq_lens = step.query_lens, step.seq_lens
    positions = [s - q + i for q, s in zip(query_lens, seq_lens, strict=True) for i in range(q)]
    requests = [r for r, q in enumerate(query_lens) for _ in range(q)]
    table = torch.tensor(step.block_table, dtype=torch.int32).view(len(query_lens), layout.pages_per_seq)
    slots = [
        int(table[r, p // layout.page_size]) * layout.page_size + p % layout.page_size
        for r, p in zip(requests, positions, strict=True)
    ]
    return {
        "input_ids": torch.zeros(len(positions), dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "query_lens": torch.tensor(query_lens, dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_table": table,
    }


@given(paged_steps())
def test_paged_metadata_is_the_real_batch_then_padding(step: PagedStepCase) -> None:
    layout = PagedLayout(step.page_size, step.num_pages, step.pages_per_seq)
    inputs = _inputs(step, layout)
    num_tokens, num_reqs = inputs["positions"].shape[0], inputs["seq_lens"].shape[0]
    shape_tokens, shape_reqs = step.shape_tokens, step.shape_reqs
    query_len = step.query_len if step.uniform else None
    shape = BatchShape(shape_tokens, shape_reqs, query_len, CUDAGraphMode.FULL)
    buffers = PagedBuffers(layout, max_tokens=shape_tokens, max_reqs=shape_reqs, device="cpu")
    batch = StepBatch(num_tokens, num_reqs, inputs)
    if num_tokens:
        check_paged_batch(layout, batch)  # a valid batch is accepted
    meta = buffers.fill(batch, shape)
    assert meta is buffers.views(shape)  # the same views, at the same addresses, that a capture records
    offsets = meta.query_start_loc.tolist()
    assert offsets[0] == 0
    # The first padding request holds the padding tokens; a shape with no padding request has none.
    assert offsets[-1] == (shape_tokens if shape_reqs > num_reqs else num_tokens)
    assert all(a <= b for a, b in itertools.pairwise(offsets))
    if query_len is None:
        assert offsets[1 : num_reqs + 1] == list(itertools.accumulate(inputs["query_lens"].tolist()))
    else:
        assert offsets == [query_len * r for r in range(shape_reqs + 1)]
    assert meta.seq_lens.tolist() == [*inputs["seq_lens"].tolist(), *[1] * (shape_reqs - num_reqs)]
    assert meta.block_table[:num_reqs].tolist() == inputs["block_table"].tolist()
    assert (meta.block_table[num_reqs:] == layout.scratch_page).all()
    requests = [r for r, q in enumerate(inputs["query_lens"].tolist()) for _ in range(q)]
    assert meta.req_ids.tolist() == [*requests, *[PAD_REQUEST] * (shape_tokens - num_tokens)]
    assert meta.positions.tolist() == [*inputs["positions"].tolist(), *[0] * (shape_tokens - num_tokens)]
    assert meta.max_query_len == (query_len if query_len is not None else shape_tokens)
    padding = buffers.fill(StepBatch.padding(), shape)  # a warm-up's: every row padding, nothing stale
    assert padding.req_ids.tolist() == [PAD_REQUEST] * shape_tokens
    assert padding.seq_lens.tolist() == [1] * shape_reqs
    assert (padding.block_table == layout.scratch_page).all()


def _sixteen_requests_of_twenty_tokens(layout: PagedLayout) -> dict[str, torch.Tensor]:
    """A valid mixed step: 16 requests (one of 5 tokens, 15 decodes), each on pages of its own."""
    query_lens = [5, *[1] * 15]
    seq_lens = [7 + 3 * r for r in range(16)]  # at most 52 keys: 7 pages of 8
    pages = iter(range(1, layout.num_pages))
    table = [[next(pages) for _ in range(layout.pages_per_seq)] for _ in query_lens]
    positions = [s - q + i for q, s in zip(query_lens, seq_lens, strict=True) for i in range(q)]
    requests = [r for r, q in enumerate(query_lens) for _ in range(q)]
    slots = [
        table[r][p // layout.page_size] * layout.page_size + p % layout.page_size
        for r, p in zip(requests, positions, strict=True)
    ]
    return {
        "input_ids": torch.arange(20, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "query_lens": torch.tensor(query_lens, dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_table": torch.tensor(table, dtype=torch.int32),
    }


def test_a_key_without_a_padding_request_ends_its_offsets_at_the_real_total() -> None:
    """Issue 39's edge (docs/design.md, "The attention seam", rule 2): FULL, ``max_num_seqs=16``,
    16 requests of 20 tokens pad to the key of 24 tokens and 16 requests; no request row is left
    for the 4 padding tokens, so the offsets end at the real total and those tokens belong to no
    request (``PAD_REQUEST``); the replay still equals the oracle."""
    out = torch.full((17,), -7, dtype=torch.int32)
    real = torch.tensor([0, 5, *range(6, 21)], dtype=torch.int32)  # 16 requests, 20 tokens
    assert pad_offsets(out, real, 24).tolist() == real.tolist()
    config = DecoderConfig.small()
    layout = PagedLayout.for_config(config, page_size=8)
    model = PagedDecoder(config, layout=layout, backend="gather", breakable=False)
    dispatch = DispatchConfig(CUDAGraphMode.FULL, CaptureSizes([8, 16, 24, 32]), max_num_seqs=16)
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        dispatch,
        device="cpu",
        options=ManagerOptions(
            engine_factory=FakeEngines(), attention=AttentionOptions(metadata_builder=model.backend)
        ),
    )
    manager.capture()
    inputs = _sixteen_requests_of_twenty_tokens(layout)
    assert manager.dispatcher.dispatch(20).descriptor == BatchDescriptor(24, 16)
    with torch.no_grad():
        served = manager.run_batch(inputs).clone()
    assert dict(manager.stats.replays) == {(CUDAGraphMode.FULL, 24): 1}
    backend = model.backend
    assert isinstance(backend, GatherPagedAttention)
    meta = backend.build_for_capture(BatchShape(24, 16, None, CUDAGraphMode.FULL)).paged
    assert meta.query_start_loc.tolist() == real.tolist()  # the last offset: 20, the real total
    assert meta.req_ids[20:].tolist() == [PAD_REQUEST] * 4  # the padding tokens: no request's
    assert rel_err(served, dense_reference(model, inputs)) < 1e-5
