"""The example decoders over reserved memory, on the CPU (issue 48): the same steps, the unbacked refused.

Each layer's cache over a ``KVCacheMemory`` is a strided view (a page or a
row holds every layer): each backend's eager step over it equals the same
step over ordinary caches holding the same K/V, so the views are the
caches. An eager step that names a page or row past the ones backed is
refused by name; what a graph step does instead (the scratch page or row,
on the device) is checked here on the metadata and slots, and on the GPU by
``test_kv_first.py``. The memory is a fake of the driver's (``tests.fake_vmm``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch
from examples import DecoderConfig
from examples.inputs import make_paged_inputs, make_step_inputs
from examples.paged import PagedBuffers, PagedDecoder, PagedLayout, paged_static_inputs, reserve_paged_cache
from examples.paged.model import _backed_slots
from examples.reference import ReferenceDecoder, reserve_row_cache
from tests.fake_vmm import FakeVirtualMemory, use_fake_vmm

CONFIG = DecoderConfig.small()
PAGE = 16
#: Pages backed of the reservation's 48 in these tests.
BACKED = 20


@pytest.fixture(autouse=True)
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeVirtualMemory]:
    driver = FakeVirtualMemory(granularity=4096)
    use_fake_vmm(monkeypatch, driver)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
        yield driver


def _reserved_paged(backend: str) -> PagedDecoder:
    kv = reserve_paged_cache(CONFIG, page_size=PAGE, max_pages=48, device="cpu")
    assert kv.back(BACKED) >= BACKED
    torch.manual_seed(0)
    model = PagedDecoder(CONFIG, backend=backend, device="cpu", kv_cache=kv)
    kv.tensor[: kv.units].normal_()  # earlier context
    return model


def _ordinary_twin(model: PagedDecoder, backend: str) -> PagedDecoder:
    """The same weights and cache contents, in ordinary (contiguous) per-layer caches."""
    twin = PagedDecoder(CONFIG, layout=model.layout, backend=backend, device="cpu")
    twin.body.load_state_dict(model.body.state_dict())
    for mine, theirs in zip(twin.caches, model.caches, strict=True):
        mine.copy_(theirs)
    return twin


@pytest.mark.parametrize("backend", ["gather", "flex", "varlen", "split_decode"])
def test_each_backends_eager_steps_over_reserved_memory_equal_ordinary_caches(backend: str) -> None:
    model = _reserved_paged(backend)
    assert model.layout == PagedLayout(PAGE, 48, CONFIG.max_seq_len // PAGE)
    assert not model.caches[0].is_contiguous(), "a layer's cache is a strided view of the pages"
    twin = _ordinary_twin(model, backend)
    generator = torch.Generator().manual_seed(1)
    kv = model.kv_cache
    assert kv is not None
    with torch.no_grad():
        for num_tokens, uniform in ((5, False), (3, True), (9, False)):
            inputs = make_paged_inputs(
                CONFIG,
                model.layout,
                num_tokens,
                uniform_decode=uniform,
                generator=generator,
                num_pages=kv.units,
            )
            mine = model.step(inputs, uniform_decode=uniform)
            theirs = twin.step(inputs, uniform_decode=uniform)
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(model.caches, twin.caches, strict=True):  # the K/V written alike
        torch.testing.assert_close(mine[:, : kv.units], theirs[:, : kv.units], rtol=0, atol=0)


def test_an_eager_step_naming_a_page_not_backed_is_refused_by_name() -> None:
    model = _reserved_paged("gather")
    kv = model.kv_cache
    assert kv is not None
    inputs = make_paged_inputs(
        CONFIG,
        model.layout,
        4,
        uniform_decode=True,
        generator=torch.Generator().manual_seed(2),
        num_pages=kv.units,
    )
    bad = dict(inputs)
    bad["block_table"] = inputs["block_table"].clone()
    bad["block_table"][1, 0] = kv.units  # the first page past the backed ones (the reservation has it)
    with pytest.raises(
        ValueError, match=rf"block_table: used pages are in \[1, {kv.units}\) \(the pages backed\)"
    ):
        model.step(bad, uniform_decode=True)
    config = DispatchConfig(CUDAGraphMode.FULL, CaptureSizes([1, 2, 4, 8]), max_num_seqs=CONFIG.max_num_seqs)
    options: ManagerOptions[torch.Tensor] = ManagerOptions(
        attention=AttentionOptions(metadata_builder=model.backend), kv_cache=kv
    )
    manager = CUDAGraphManager(
        model, paged_static_inputs(model.layout), config, device="cpu", options=options
    )
    with pytest.raises(ValueError, match="block_table: used pages are in"):
        manager.run_batch(bad, uniform_decode=True)
    assert manager.stats.eager_steps == 0


def test_the_metadata_sends_pages_not_backed_to_the_scratch_page_on_the_device() -> None:
    layout = PagedLayout(PAGE, 48, 4)
    limit = torch.tensor(10)
    buffers = PagedBuffers(layout, 16, 4, "cpu", validate=False, page_limit=limit)
    table = torch.tensor([[3, 9, 10, 47], [-1, 2, 30, 5]], dtype=torch.int32)
    inputs = {
        "query_lens": torch.tensor([1, 1], dtype=torch.int32),
        "seq_lens": torch.tensor([64, 64], dtype=torch.int32),
        "block_table": table,
        "positions": torch.tensor([63, 63]),
        "slot_mapping": torch.tensor([47 * PAGE + 15, 5 * PAGE + 15]),
    }
    shape = BatchShape(4, 4, 1, CUDAGraphMode.FULL)
    meta = buffers.fill(StepBatch(2, 2, inputs), shape)
    assert meta.block_table.tolist() == [[3, 9, 0, 0], [0, 2, 0, 5], [0, 0, 0, 0], [0, 0, 0, 0]]
    limit.fill_(48)  # backed later: the same buffers, no recapture, the pages pass
    assert buffers.fill(StepBatch(2, 2, inputs), shape).block_table[0].tolist() == [3, 9, 10, 47]
    slots = torch.tensor([0, 10 * PAGE - 1, 10 * PAGE, -3, 47 * PAGE])
    assert _backed_slots(slots, torch.tensor(10), layout).tolist() == [0, 10 * PAGE - 1, 0, 0, 0]


def test_the_row_cache_over_reserved_memory_refuses_unbacked_rows_eagerly_and_clamps_them_in_graphs() -> None:
    kv = reserve_row_cache(CONFIG, max_rows=64, device="cpu")
    assert kv.units >= CONFIG.max_num_seqs + 1
    assert kv.min_units == CONFIG.max_num_seqs + 1
    assert kv.back(40) >= 40
    torch.manual_seed(0)
    model = ReferenceDecoder(CONFIG, device="cpu", kv_cache=kv)
    kv.tensor[: kv.units].normal_()
    twin = ReferenceDecoder(CONFIG, device="cpu")
    twin.body.load_state_dict(model.body.state_dict())
    for mine, theirs in zip(twin.caches, model.caches, strict=True):
        mine.copy_(theirs[: CONFIG.max_num_seqs + 1])
    inputs = make_step_inputs(CONFIG, 6, uniform_decode=False, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model.step(inputs), twin.step(inputs), rtol=1e-5, atol=1e-5)
        rows = torch.tensor([0, kv.units - 1, kv.units, 63, -1])
        positions = torch.zeros(5, dtype=torch.int64)
        with pytest.raises(ValueError, match=rf"cache_rows: rows \[{kv.units}, 63, -1\] are not backed"):
            model.metadata(positions, rows)
        with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(5)):  # as in a graph: no host read
            meta = model.metadata(positions, rows)
    scratch = CONFIG.scratch_row
    assert meta.cache_rows.tolist() == [0, kv.units - 1, scratch, scratch, scratch]


def test_a_model_over_memory_of_another_shape_is_refused_by_name() -> None:
    kv = reserve_paged_cache(CONFIG, page_size=PAGE, max_pages=48, device="cpu")
    rows = reserve_row_cache(CONFIG, max_rows=32, device="cpu")
    with pytest.raises(ValueError, match=r"kv_cache: units of .* expected pages of"):
        PagedDecoder(CONFIG, device="cpu", kv_cache=rows)
    with pytest.raises(ValueError, match=r"kv_cache: units of .* expected rows of"):
        ReferenceDecoder(CONFIG, device="cpu", kv_cache=kv)
    with pytest.raises(ValueError, match=r"layout: .* disagrees with kv_cache's 48 pages of 16"):
        PagedDecoder(CONFIG, layout=PagedLayout(PAGE, 40, 4), device="cpu", kv_cache=kv)
    model = PagedDecoder(CONFIG, backend="gather", device="cpu", kv_cache=kv)
    with pytest.raises(ValueError, match=r"num_pages: this model's cache is reserved memory of 48 pages"):
        model.allocate_kv_cache(10)
    from examples.paged import GatherPagedAttention

    plain = GatherPagedAttention(model.layout, CONFIG.dtype, max_tokens=64, max_reqs=16, device="cpu")
    with pytest.raises(ValueError, match=r"backend: .* was not built with page_limit=kv_cache.limit"):
        PagedDecoder(CONFIG, backend=plain, device="cpu", kv_cache=kv)
