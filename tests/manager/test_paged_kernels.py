"""The varlen and split-decode paged kernels and backends against a float64 per-request oracle.

Random paged layouts: pages shuffled, ragged lengths, block-table entries
past a request's length holding random pages, prefill chunks mixed with
decodes. CPU tests run the kernels in float32 (the varlen stand-in on the
CPU) and the backends through their metadata; GPU tests run the real
kernels in bfloat16 and inside a ``torch.cuda.CUDAGraph`` whose metadata is
refilled between replays.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Final

import pytest
import torch

from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_dispatch._support import resolve_mode
from cudagraph_dispatch.support import GraphSupport
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch, metadata_extra
from examples.paged.batch import paged_static_inputs
from examples.paged.layout import PagedLayout
from examples.paged.split_decode import (
    Prefill,
    SplitDecodeAttention,
    planned_attention,
    split_count,
    split_decode_attention,
)
from examples.paged.varlen import VarlenPagedAttention, paged_kernel_accepts
from examples.paged.varlen_kernels import PAGED_VARLEN, gathered_key_slots, varlen_paged_attention
from tests.manager.helpers import FakeEngines
from tests.torch_support import highest_fp32_matmul_precision, rel_err

M: Final = CUDAGraphMode
HEADS: Final = 2
HEAD_DIM: Final = 64  # FlashAttention's: a multiple of 8
#: Query lengths of the batches drawn: decodes, prefill chunks mixed with decodes, one long prefill.
MIXES: Final = ((1, 1, 1, 1, 1), (7, 1, 1, 12, 1, 3), (1,), (29,))
PATHS: Final = (False, True) if PAGED_VARLEN else (False,)


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One random step on a random paged cache: the kernels' arguments, and the backends' inputs."""

    q: torch.Tensor  # [T, heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_pages, page_size, heads, head_dim]: this step's K/V already in place
    query_start_loc: torch.Tensor  # [R + 1] int32
    inputs: dict[str, torch.Tensor]  # the six paged inputs (batch.PAGED_INPUT_NAMES)

    @property
    def k(self) -> torch.Tensor:  # [T, heads, head_dim]: what this step writes (already there)
        return _flat(self.kv_cache)[0][self.inputs["slot_mapping"]]

    @property
    def v(self) -> torch.Tensor:
        return _flat(self.kv_cache)[1][self.inputs["slot_mapping"]]

    def batch(self) -> StepBatch:
        return StepBatch(self.q.shape[0], len(self.inputs["seq_lens"]), self.inputs)


def _flat(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.view(2, -1, HEADS, HEAD_DIM)  # [2, num_pages * page_size, heads, head_dim]


def random_step(
    layout: PagedLayout, query_lens: tuple[int, ...], *, seed: int, dtype: torch.dtype = torch.float32
) -> Step:
    """Requests of ``query_lens`` tokens at random places in their sequences, on shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    page_size, width = layout.page_size, layout.pages_per_seq
    ends = [int(torch.randint(n, layout.max_seq_len + 1, (), generator=g)) for n in query_lens]
    pool = (torch.randperm(layout.num_pages - 1, generator=g) + 1).tolist()  # every page but scratch
    table = torch.randint(1, layout.num_pages, (len(query_lens), width), generator=g, dtype=torch.int32)
    positions = []
    for r, (n, end) in enumerate(zip(query_lens, ends, strict=True)):
        used = -(-end // page_size)
        table[r, :used] = torch.tensor(pool[:used], dtype=torch.int32)
        del pool[:used]
        positions.append(torch.arange(end - n, end))
    position = torch.cat(positions)  # [T]
    lens = torch.tensor(query_lens, dtype=torch.int32)
    req = torch.repeat_interleave(torch.arange(len(query_lens)), lens.long())  # [T]
    slots = table[req, position // page_size].long() * page_size + position % page_size  # [T]
    shape = (2, layout.num_pages, layout.page_size, HEADS, HEAD_DIM)
    inputs = {
        "input_ids": torch.zeros_like(position),
        "positions": position,
        "slot_mapping": slots,
        "query_lens": lens,
        "seq_lens": torch.tensor(ends, dtype=torch.int32),
        "block_table": table,
    }
    q = torch.randn(len(position), HEADS, HEAD_DIM, generator=g).to(dtype)
    kv_cache = torch.randn(shape, generator=g).to(dtype)
    starts = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return Step(q, kv_cache, starts, inputs)


def oracle(step: Step) -> torch.Tensor:
    """Each token over its request's keys up to its position, in float64, one request at a time."""
    inputs, page_size = step.inputs, step.kv_cache.shape[2]
    out = torch.empty(step.q.shape, dtype=torch.float64)
    keys, values = _flat(step.kv_cache.cpu().double())
    starts = step.query_start_loc.tolist()
    for r, end in enumerate(inputs["seq_lens"].tolist()):
        logical = torch.arange(end)
        slots = inputs["block_table"][r].cpu().long()[logical // page_size] * page_size + logical % page_size
        first, last = starts[r], starts[r + 1]
        q = step.q[first:last].cpu().double()  # [n, heads, head_dim]
        scores = torch.einsum("nhd,lhd->hnl", q, keys[slots]) * HEAD_DIM**-0.5  # [heads, n, L]
        hidden = logical[None, :] > torch.arange(end - (last - first), end)[:, None]  # [n, L]
        weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[first:last] = torch.einsum("hnl,lhd->nhd", weights, values[slots])
    return out


def _to(step: Step, device: torch.device, dtype: torch.dtype) -> Step:
    inputs = {name: value.to(device) for name, value in step.inputs.items()}
    return Step(
        step.q.to(device, dtype), step.kv_cache.to(device, dtype), step.query_start_loc.to(device), inputs
    )


# --- the kernels, as functions ------------------------------------------------------------------


@pytest.mark.parametrize("paged", PATHS)
@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("query_lens", MIXES)
def test_varlen_kernel_equals_the_oracle(paged: bool, page_size: int, query_lens: tuple[int, ...]) -> None:
    layout = PagedLayout(page_size, num_pages=80, pages_per_seq=64 // page_size + 1)
    step = random_step(layout, query_lens, seed=page_size * 31 + len(query_lens))
    inputs = step.inputs
    with highest_fp32_matmul_precision():
        out = varlen_paged_attention(
            step.q,
            step.kv_cache,
            step.query_start_loc,
            inputs["seq_lens"],
            inputs["block_table"],
            max(query_lens),
            layout.max_seq_len,
            paged=paged,
        )
    assert rel_err(out, oracle(step)) < 1e-5


def test_gathered_key_slots_map_packed_rows_through_the_block_table() -> None:
    seq_lens = torch.tensor([3, 1], dtype=torch.int32)
    table = torch.tensor([[7, 2], [5, 9]], dtype=torch.int32)  # page size 2: request 0 reads 7, then 2
    cu_seq_k, slots = gathered_key_slots(seq_lens, table, page_size=2, max_k=4)
    assert cu_seq_k.tolist() == [0, 3, 4]
    # request 0: slots 14, 15, 4; request 1: slot 10; the rows past the total read the scratch slot.
    assert slots.tolist() == [14, 15, 4, 10, 0, 0, 0, 0]


def test_varlen_padding_requests_leave_real_rows_alone_and_make_no_nan() -> None:
    """A padded mixed batch: the first padding request holds every padding token over one scratch key."""
    layout = PagedLayout(16, num_pages=40, pages_per_seq=4)
    step = random_step(layout, (5, 1, 3), seed=3)
    real, padded, reqs = 9, 16, 5
    q = torch.cat((step.q, torch.randn(padded - real, HEADS, HEAD_DIM)))
    starts = torch.tensor([*step.query_start_loc.tolist(), padded, padded], dtype=torch.int32)
    seq_lens = torch.cat((step.inputs["seq_lens"], torch.ones(reqs - 3, dtype=torch.int32)))
    table = torch.cat((step.inputs["block_table"], torch.zeros(reqs - 3, 4, dtype=torch.int32)))
    for paged in PATHS:
        out = varlen_paged_attention(q, step.kv_cache, starts, seq_lens, table, padded, 64, paged=paged)
        assert not out.isnan().any()
        assert rel_err(out[:real], oracle(step)) < 1e-5
        assert out[real : padded - 1].abs().max() == 0  # rows that see no key: zeros, as FlashAttention's


def test_varlen_stand_in_checks_the_bounds_the_kernel_trusts() -> None:
    layout = PagedLayout(16, num_pages=40, pages_per_seq=4)
    step = random_step(layout, (5, 1), seed=4)
    args = (step.q, step.kv_cache, step.query_start_loc, step.inputs["seq_lens"], step.inputs["block_table"])
    with pytest.raises(ValueError, match="exceed max_q=4"):
        varlen_paged_attention(*args, 4, 64, paged=False)


def test_split_count_is_a_power_of_two_that_falls_as_requests_grow() -> None:
    counts = [split_count(r, 32) for r in range(1, 300)]
    assert counts[0] == 32
    assert counts[-1] == 1
    assert all(a >= b for a, b in itertools.pairwise(counts))
    assert all(c & (c - 1) == 0 for c in counts)
    assert split_count(1, 5) == 4  # never more than the row's pages
    assert split_count(1, 1) == 1


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("page_size", [16, 3])
def test_split_decode_kernel_equals_the_oracle(num_splits: int, page_size: int) -> None:
    layout = PagedLayout(page_size, num_pages=200, pages_per_seq=96 // page_size)
    step = random_step(layout, (1,) * 7, seed=num_splits + page_size)
    inputs = step.inputs
    with highest_fp32_matmul_precision():
        out = split_decode_attention(
            step.q, step.kv_cache, inputs["seq_lens"], inputs["block_table"], num_splits
        )
    assert rel_err(out, oracle(step)) < 1e-5


@pytest.mark.parametrize("query_lens", MIXES)
def test_planned_path_equals_the_oracle(query_lens: tuple[int, ...]) -> None:
    layout = PagedLayout(16, num_pages=80, pages_per_seq=4)
    step = random_step(layout, query_lens, seed=len(query_lens))
    inputs = step.inputs
    with highest_fp32_matmul_precision():
        out = planned_attention(
            step.q, step.kv_cache, step.query_start_loc.tolist(), inputs["seq_lens"], inputs["block_table"]
        )
    assert rel_err(out, oracle(step)) < 1e-5


# --- the backends, through their metadata -------------------------------------------------------

Backend = VarlenPagedAttention | SplitDecodeAttention


def attend(backend: Backend, step: Step, metadata: object, shape: BatchShape) -> torch.Tensor:
    """``backend.attend`` of ``step`` padded to ``shape``, under a forward context holding ``metadata``."""
    pad = shape.num_tokens - step.q.shape[0]
    q = torch.cat((step.q, step.q.new_zeros(pad, HEADS, HEAD_DIM)))
    k, v = (torch.cat((t, t.new_zeros(pad, HEADS, HEAD_DIM))) for t in (step.k, step.v))
    slots = torch.cat((step.inputs["slot_mapping"], step.q.new_zeros(pad, dtype=torch.int64)))
    out = torch.full_like(q, float("nan"))
    key = BatchDescriptor(shape.num_tokens, shape.num_reqs, shape.uniform)
    with set_forward_context(shape.mode, key, **metadata_extra(backend, metadata)):
        backend.attend(q, k, v, step.kv_cache, slots, out)
    return out[: step.q.shape[0]]


def _layout() -> PagedLayout:
    return PagedLayout(16, num_pages=120, pages_per_seq=5)


@pytest.mark.parametrize("paged", PATHS)
@pytest.mark.parametrize(
    "shape",
    [
        BatchShape(21, 8, None, M.FULL),  # mixed, padded: 3 padding requests
        BatchShape(21, 5, None, M.NONE),  # the real batch, eager
        BatchShape(32, 8, None, M.PIECEWISE),
    ],
)
def test_varlen_backend_equals_the_oracle(paged: bool, shape: BatchShape) -> None:
    layout = _layout()
    backend = VarlenPagedAttention(layout, max_tokens=32, max_reqs=8, paged=paged)
    assert backend.support.level is GraphSupport.ALWAYS
    step = random_step(layout, (7, 1, 1, 11, 1), seed=shape.num_tokens + shape.num_reqs)
    meta = backend.build(step.batch(), shape)
    captured = backend.build_for_capture(shape)
    assert captured.paged.seq_lens.data_ptr() == meta.paged.seq_lens.data_ptr()
    if not paged:  # the gathered path's key map lives in the backend's buffers, at fixed addresses
        assert captured.key_slots is not None
        assert meta.key_slots is not None
        assert captured.key_slots.data_ptr() == meta.key_slots.data_ptr()
    with highest_fp32_matmul_precision():
        assert rel_err(attend(backend, step, meta, shape), oracle(step)) < 1e-5


def test_varlen_backend_decodes_as_a_uniform_shape() -> None:
    layout = _layout()
    backend = VarlenPagedAttention(layout, max_tokens=32, max_reqs=8, paged=False)
    step = random_step(layout, (1,) * 6, seed=11)
    shape = BatchShape(8, 8, 1, M.FULL)
    meta = backend.build(step.batch(), shape)
    assert meta.paged.max_query_len == 1
    with highest_fp32_matmul_precision():
        assert rel_err(attend(backend, step, meta, shape), oracle(step)) < 1e-5


def test_split_decode_declares_decodes_only_and_the_manager_keeps_mixed_batches_out_of_full_graphs() -> None:
    backend = SplitDecodeAttention(_layout(), max_tokens=32, max_reqs=8)
    assert backend.support.level is GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    config = DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([8, 16]), max_num_seqs=8)
    assert resolve_mode(config, backend.support).mode is M.FULL_AND_PIECEWISE  # FULL decodes, PIECEWISE rest
    full = dataclasses.replace(config, mode=M.FULL)
    assert resolve_mode(full, backend.support).mode is M.FULL_AND_PIECEWISE


@pytest.mark.parametrize(
    ("query_lens", "shape", "splits"),
    [
        ((1,) * 6, BatchShape(8, 8, 1, M.FULL), split_count(8, 5)),  # the decode kernel, padded
        ((1,) * 2, BatchShape(2, 2, 1, M.NONE), split_count(2, 5)),
        ((7, 1, 1, 11, 1), BatchShape(21, 5, None, M.NONE), None),  # a prefill path: eager
        ((7, 1, 1, 11, 1), BatchShape(32, 8, None, M.PIECEWISE), None),
    ],
)
def test_split_decode_planned_backend_equals_the_oracle(
    query_lens: tuple[int, ...], shape: BatchShape, splits: int | None
) -> None:
    layout = _layout()
    backend = SplitDecodeAttention(layout, max_tokens=32, max_reqs=8, prefill="planned")
    step = random_step(layout, query_lens, seed=len(query_lens) + shape.num_tokens)
    meta = backend.build(step.batch(), shape)
    assert meta.num_splits == splits
    assert meta.prefill is None
    with highest_fp32_matmul_precision():
        assert rel_err(attend(backend, step, meta, shape), oracle(step)) < 1e-5
        again = attend(backend, step, meta, shape)  # a second layer: the plan read once per step
    assert len(meta.read) == (0 if splits else 1)
    assert rel_err(again, oracle(step)) < 1e-5


@pytest.mark.parametrize(
    ("query_lens", "shape"),
    [
        ((7, 1, 1, 11, 1), BatchShape(21, 5, None, M.NONE)),  # eager
        ((7, 1, 1, 11, 1), BatchShape(32, 8, None, M.PIECEWISE)),  # a mixed key, padded
        ((7, 1, 1, 11, 1), BatchShape(21, 8, None, M.FULL)),  # a FULL mixed key (declare=ALWAYS)
        ((3, 3, 3), BatchShape(12, 4, 3, M.FULL)),  # a uniform key of 3 queries per request
        ((1,) * 6, BatchShape(8, 8, 1, M.FULL)),  # a decode: the split-decode kernel
    ],
)
def test_split_decode_mixed_keys_take_the_varlen_prefill_path(
    query_lens: tuple[int, ...], shape: BatchShape
) -> None:
    """The default prefill path: the varlen backend's metadata and kernel, no plan read on the host."""
    layout = _layout()
    backend = SplitDecodeAttention(layout, max_tokens=32, max_reqs=8)
    step = random_step(layout, query_lens, seed=len(query_lens) + shape.num_tokens)
    meta = backend.build(step.batch(), shape)
    captured = backend.build_for_capture(shape)
    decode = shape.query_len == 1
    assert (meta.num_splits is not None, meta.prefill is None, captured.prefill is None) == (decode,) * 3
    assert meta.plan is None
    assert captured.plan is None
    assert captured.paged.seq_lens.data_ptr() == meta.paged.seq_lens.data_ptr()  # one set of buffers
    with highest_fp32_matmul_precision():
        assert rel_err(attend(backend, step, meta, shape), oracle(step)) < 1e-5
        again = attend(backend, step, captured, shape)  # as a graph recorded with the capture's metadata
    assert meta.read == []  # nothing read on the host
    assert rel_err(again, oracle(step)) < 1e-5


def test_split_decode_prefill_is_checked() -> None:
    with pytest.raises(ValueError, match=r"prefill: expected one of \['varlen', 'planned'\], got 'flash'"):
        SplitDecodeAttention(_layout(), max_tokens=32, max_reqs=8, prefill="flash")  # type: ignore[arg-type]


def test_split_decode_over_declared_bakes_the_capture_plan_into_a_full_mixed_graph() -> None:
    """``declare=ALWAYS``: a FULL mixed key's plan is its shape's (all tokens in request 0): wrong."""
    layout = _layout()
    backend = SplitDecodeAttention(
        layout, max_tokens=32, max_reqs=8, declare=GraphSupport.ALWAYS, prefill="planned"
    )
    assert backend.support.level is GraphSupport.ALWAYS
    shape = BatchShape(21, 8, None, M.FULL)
    captured = backend.build_for_capture(shape)
    assert captured.plan == (0, *[21] * 8)
    step = random_step(layout, (7, 1, 1, 11, 1), seed=5)
    meta = backend.build(step.batch(), shape)  # the replay's buffers; the graph keeps the capture's plan
    assert meta.plan == captured.plan
    with highest_fp32_matmul_precision():
        assert rel_err(attend(backend, step, captured, shape), oracle(step)) > 0.1


# --- through the manager (CPU, fake graph engines): the downgrade end to end ---------------------------


class _AttentionModel(torch.nn.Module):
    """One attention layer over a paged cache: q, k, v from embeddings of the tokens."""

    def __init__(self, backend: Backend, vocab: int = 50) -> None:
        super().__init__()
        layout = backend.layout
        self.backend = backend
        self.embed = torch.nn.Parameter(torch.randn(vocab, 3 * HEADS * HEAD_DIM))
        self.kv_cache = torch.randn(2, layout.num_pages, layout.page_size, HEADS, HEAD_DIM)

    def qkv(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.nn.functional.embedding(input_ids, self.embed).view(-1, 3, HEADS, HEAD_DIM).unbind(1)

    def forward(self, input_ids: torch.Tensor, slot_mapping: torch.Tensor, **_: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(input_ids)  # [T, heads, head_dim] each
        out = torch.empty_like(q)
        self.backend.attend(q, k, v, self.kv_cache, slot_mapping, out)
        return out.flatten(1)  # [T, heads * head_dim]


def _manager_run(
    declare: GraphSupport, mode: CUDAGraphMode, prefill: Prefill = "varlen"
) -> tuple[CUDAGraphManager[torch.Tensor], list[float]]:
    """A decode step, then a mixed one, through a captured manager; each step's error vs the oracle."""
    layout = _layout()
    backend = SplitDecodeAttention(layout, max_tokens=32, max_reqs=8, declare=declare, prefill=prefill)
    model = _AttentionModel(backend)
    config = DispatchConfig(mode, CaptureSizes([8, 16, 32]), max_num_seqs=8)
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        config,
        device="cpu",
        options=ManagerOptions(
            engine_factory=FakeEngines(), attention=AttentionOptions(metadata_builder=backend)
        ),
    )
    manager.capture()
    errors = []
    for seed, query_lens in enumerate(((1,) * 5, (7, 1, 1, 11, 1))):
        step = random_step(layout, query_lens, seed=seed)
        step.inputs["input_ids"] = torch.randint(0, 50, step.inputs["input_ids"].shape)
        with torch.no_grad(), highest_fp32_matmul_precision():
            out = manager.run_batch(step.inputs, uniform_decode=len(set(query_lens)) == 1)
            q = model.qkv(step.inputs["input_ids"])[0]
        expected = oracle(Step(q, model.kv_cache, step.query_start_loc, step.inputs))
        errors.append(rel_err(out.view(-1, HEADS, HEAD_DIM), expected))
    return manager, errors


@pytest.mark.parametrize("prefill", ["varlen", "planned"])
def test_split_decode_through_the_manager_full_for_decodes_piecewise_for_mixed_batches(
    prefill: Prefill,
) -> None:
    manager, errors = _manager_run(GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, M.FULL, prefill)
    stats = manager.stats
    assert stats.resolution is not None
    assert stats.resolution.mode is M.FULL_AND_PIECEWISE  # FULL asked, downgraded for mixed batches
    assert dict(stats.replays) == {(M.FULL, 8): 1, (M.PIECEWISE, 32): 1}
    assert max(errors) < 1e-5


def test_split_decode_over_declared_through_the_manager_replays_batches_wrong() -> None:
    """FULL with ``ALWAYS`` declared: mixed keys only, each baking its capture's plan (padding's)."""
    manager, errors = _manager_run(GraphSupport.ALWAYS, M.FULL, "planned")
    stats = manager.stats
    assert stats.resolution is not None
    assert not stats.resolution.downgraded
    assert dict(stats.replays) == {(M.FULL, 8): 1, (M.FULL, 32): 1}  # the decode too: FULL has no decode keys
    assert min(errors) > 0.1


def test_split_decode_with_the_varlen_prefill_holds_full_mixed_graphs_through_the_manager() -> None:
    """``declare=ALWAYS`` is true of the varlen prefill path: FULL mixed keys replay any batch right."""
    manager, errors = _manager_run(GraphSupport.ALWAYS, M.FULL)
    assert dict(manager.stats.replays) == {(M.FULL, 8): 1, (M.FULL, 32): 1}
    assert max(errors) < 1e-5


# --- on CUDA: the real kernels in bfloat16, and in a CUDA graph refilled between replays --------------


def _cuda_paths(page_size: int) -> list[bool]:
    """The gathered path, and the paged one where the installed ``varlen_attn`` reads these pages."""
    return [
        False,
        *([True] if PAGED_VARLEN and paged_kernel_accepts(page_size, torch.device("cuda")) else []),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("query_lens", MIXES)
def test_varlen_kernel_on_cuda_equals_the_oracle(query_lens: tuple[int, ...]) -> None:
    layout = PagedLayout(16, num_pages=80, pages_per_seq=5)
    step = _to(random_step(layout, query_lens, seed=len(query_lens)), torch.device("cuda"), torch.bfloat16)
    inputs = step.inputs
    for paged in _cuda_paths(layout.page_size):
        out = varlen_paged_attention(
            step.q,
            step.kv_cache,
            step.query_start_loc,
            inputs["seq_lens"],
            inputs["block_table"],
            max(query_lens),
            layout.max_seq_len,
            paged=paged,
        )
        assert rel_err(out, oracle(step)) < 2e-2, f"paged={paged}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_split_decode_kernel_on_cuda_equals_the_oracle(num_splits: int) -> None:
    layout = PagedLayout(16, num_pages=80, pages_per_seq=5)
    step = _to(random_step(layout, (1,) * 7, seed=num_splits), torch.device("cuda"), torch.bfloat16)
    inputs = step.inputs
    out = split_decode_attention(step.q, step.kv_cache, inputs["seq_lens"], inputs["block_table"], num_splits)
    assert rel_err(out, oracle(step)) < 2e-2


class _Static:
    """A graph's inputs and output at fixed addresses, sized for ``shape``; ``load`` copies a step in."""

    def __init__(self, layout: PagedLayout, shape: BatchShape) -> None:
        cuda, dtype = torch.device("cuda"), torch.bfloat16
        self.q = torch.zeros(shape.num_tokens, HEADS, HEAD_DIM, device=cuda, dtype=dtype)  # [T, h, d]
        self.k, self.v, self.out = (
            torch.zeros_like(self.q),
            torch.zeros_like(self.q),
            torch.zeros_like(self.q),
        )
        self.slots = torch.zeros(shape.num_tokens, dtype=torch.int64, device=cuda)  # padding: scratch slot
        cache = (2, layout.num_pages, layout.page_size, HEADS, HEAD_DIM)
        self.kv_cache = torch.zeros(cache, device=cuda, dtype=dtype)

    def load(self, step: Step) -> None:
        real = step.q.shape[0]
        self.kv_cache.copy_(step.kv_cache)
        for static, value in ((self.q, step.q), (self.k, step.k), (self.v, step.v)):
            static.zero_()
            static[:real].copy_(value)
        self.slots.zero_()
        self.slots[:real].copy_(step.inputs["slot_mapping"])

    def attend(self, backend: Backend, metadata: object, shape: BatchShape) -> None:
        key = BatchDescriptor(shape.num_tokens, shape.num_reqs, shape.uniform)
        with set_forward_context(shape.mode, key, **metadata_extra(backend, metadata)):
            backend.attend(self.q, self.k, self.v, self.kv_cache, self.slots, self.out)


def graph_errors(backend: Backend, shape: BatchShape, steps: list[Step]) -> list[float]:
    """Capture ``backend.attend`` for ``shape``, then per step: load, build, replay; each error vs the oracle.

    The graph records with ``build_for_capture``'s metadata, as the manager
    records; every replay's metadata is refilled in place by ``build``.
    """
    static = _Static(backend.layout, shape)
    static.load(steps[0])
    static.attend(backend, backend.build(steps[0].batch(), shape), shape)  # the warm-up, eager
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    capture = backend.build_for_capture(shape)
    with torch.cuda.graph(graph):
        static.attend(backend, capture, shape)
    errors = []
    for step in steps:
        static.load(step)
        backend.build(step.batch(), shape)
        graph.replay()
        torch.cuda.synchronize()
        assert not static.out.isnan().any()  # padding rows included
        errors.append(rel_err(static.out[: step.q.shape[0]], oracle(step)))
    return errors


def _cuda_steps(layout: PagedLayout, mixes: tuple[tuple[int, ...], ...]) -> list[Step]:
    return [
        _to(random_step(layout, query_lens, seed=i), torch.device("cuda"), torch.bfloat16)
        for i, query_lens in enumerate(mixes)
    ]


@pytest.mark.gpu
def test_varlen_full_graph_replays_any_batch_of_its_key_on_cuda() -> None:
    layout = PagedLayout(16, num_pages=120, pages_per_seq=5)
    shape = BatchShape(48, 8, None, M.FULL)  # mixed, padded: requests and tokens of padding
    mixes = ((7, 1, 1, 12, 1, 3), (29,), (1, 1, 1, 1, 1), (5, 16, 2, 1, 1, 1, 9))
    for paged in _cuda_paths(layout.page_size):
        backend = VarlenPagedAttention(layout, max_tokens=48, max_reqs=8, device="cuda", paged=paged)
        errors = graph_errors(backend, shape, _cuda_steps(layout, mixes))
        assert max(errors) < 2e-2, f"paged={paged}: {errors}"


@pytest.mark.gpu
def test_split_decode_full_graph_replays_decodes_on_cuda() -> None:
    layout = PagedLayout(16, num_pages=120, pages_per_seq=5)
    backend = SplitDecodeAttention(layout, max_tokens=8, max_reqs=8, device="cuda")
    shape = BatchShape(8, 8, 1, M.FULL)
    errors = graph_errors(backend, shape, _cuda_steps(layout, ((1,) * 8, (1,) * 5, (1,) * 7)))
    assert max(errors) < 2e-2, errors


@pytest.mark.gpu
def test_split_decode_over_declared_full_mixed_graph_replays_wrong_on_cuda() -> None:
    """``declare=ALWAYS`` lets a FULL graph hold a mixed key: it replays its capture's plan, wrong."""
    layout = PagedLayout(16, num_pages=120, pages_per_seq=5)
    backend = SplitDecodeAttention(
        layout, max_tokens=48, max_reqs=8, device="cuda", declare=GraphSupport.ALWAYS, prefill="planned"
    )
    shape = BatchShape(48, 8, None, M.FULL)
    errors = graph_errors(backend, shape, _cuda_steps(layout, ((7, 1, 1, 12, 1, 3), (5, 16, 2, 1, 1, 1, 9))))
    assert min(errors) > 0.1, errors


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_split_decode_varlen_prefill_graph_replays_any_mixed_batch_on_cuda(mode: CUDAGraphMode) -> None:
    """The varlen prefill path in a graph of a mixed key (a FULL one with ``declare=ALWAYS``): right."""
    layout = PagedLayout(16, num_pages=120, pages_per_seq=5)
    backend = SplitDecodeAttention(
        layout, max_tokens=48, max_reqs=8, device="cuda", declare=GraphSupport.ALWAYS, breakable=False
    )
    shape = BatchShape(48, 8, None, mode)
    mixes = ((7, 1, 1, 12, 1, 3), (29,), (1, 1, 1, 1, 1), (5, 16, 2, 1, 1, 1, 9))
    errors = graph_errors(backend, shape, _cuda_steps(layout, mixes))
    assert max(errors) < 2e-2, errors
