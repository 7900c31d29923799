"""The paged reference decoder and its attention backends, with the manager resolving their support.

CPU tests check each backend against a per-request float64 oracle on random
paged layouts (shuffled pages, block-table entries past a request's length
holding random pages, ragged lengths, prefill chunks mixed with decodes).
GPU tests capture every mode with each backend and compare every replay with
eager on fresh random steps, block tables rewritten between replays.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_dispatch._support import ModeNotSupportedError
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions
from examples import DecoderConfig, ReferenceDecoder
from examples.inputs import make_paged_inputs
from examples.paged import (
    FlexPagedAttention,
    PagedDecoder,
    PagedLayout,
    paged_static_inputs,
    tile_unions,
)
from tests.manager.oracles import dense_reference
from tests.torch_support import eager_flex_is_expected as eager_flex_is_expected  # autouse
from tests.torch_support import highest_fp32_matmul_precision, rel_err

M: Final = CUDAGraphMode
SMALL: Final = DecoderConfig.small()


def _eager(model: PagedDecoder, inputs: dict[str, torch.Tensor], uniform: bool) -> torch.Tensor:
    """The model run eagerly, told (as the manager tells it) whether the batch is uniform."""
    with torch.no_grad():
        return model.step(inputs, uniform_decode=uniform)


@pytest.mark.parametrize("backend", ["gather", "flex"])
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize(
    ("num_tokens", "uniform", "query_len"), [(37, False, 1), (1, False, 1), (9, True, 1), (12, True, 3)]
)
def test_each_backend_equals_the_per_request_oracle_on_random_pages(
    backend: str, page_size: int, num_tokens: int, uniform: bool, query_len: int
) -> None:
    layout = PagedLayout.for_config(SMALL, page_size=page_size)
    torch.manual_seed(3)
    model = PagedDecoder(SMALL, layout=layout, backend=backend, breakable=False)
    generator = torch.Generator().manual_seed(num_tokens * page_size)
    for _ in range(2):  # a fresh layout each time: the tables are rewritten
        inputs = make_paged_inputs(
            SMALL, layout, num_tokens, uniform_decode=uniform, query_len=query_len, generator=generator
        )
        expected = dense_reference(model, inputs)
        assert rel_err(_eager(model, inputs, uniform), expected) < 1e-5


def test_unused_block_table_entries_and_other_requests_pages_are_never_read() -> None:
    """Poisoning every page no token may read changes nothing; poisoning one it reads does.

    A large finite poison: the eager (CPU) paths read masked keys too, and
    only the mask keeps them out (a NaN would spread through a zero weight).
    """
    layout = PagedLayout.for_config(SMALL, page_size=8)
    model = PagedDecoder(SMALL, layout=layout, backend="flex", breakable=False)
    inputs = make_paged_inputs(
        SMALL, layout, 20, uniform_decode=False, generator=torch.Generator().manual_seed(5)
    )
    before = _eager(model, inputs, False)
    used = {
        int(page)
        for r in range(inputs["block_table"].shape[0])
        for page in inputs["block_table"][r, : -(-int(inputs["seq_lens"][r]) // 8)]
    }
    unused = [p for p in range(layout.num_pages) if p not in used]
    for cache in model.kv_caches():
        cache[:, unused] = 1e4
    assert torch.equal(_eager(model, inputs, False), before)
    for cache in model.kv_caches():
        cache[:, sorted(used)[0]] = -1e4
    assert not torch.allclose(_eager(model, inputs, False), before)


def test_the_manager_takes_the_models_support_and_reports_the_resolution(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = PagedLayout.for_config(SMALL, page_size=16)
    model = PagedDecoder(SMALL, layout=layout, backend="gather")
    config = DispatchConfig(M.FULL, CaptureSizes.default(16), max_num_seqs=16, uniform_decode_query_len=3)
    assert model.graph_support().level is GraphSupport.ALWAYS
    kept = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        config,
        device="cpu",
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )
    assert kept.dispatcher.resolution.mode is M.FULL
    declared = AttentionSupport(GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, name="decode_only")
    with caplog.at_level(logging.WARNING, logger="cudagraph_dispatch"):
        manager = CUDAGraphManager(
            model,
            paged_static_inputs(layout),
            config,
            device="cpu",
            options=ManagerOptions(
                attention=AttentionOptions(support=declared, metadata_builder=model.backend)
            ),
        )
    assert manager.dispatcher.resolution.mode is M.PIECEWISE
    assert len(caplog.records) == 2
    assert "FULL -> PIECEWISE" in str(manager.stats)
    assert "decode_only" in str(manager.stats)
    assert manager.stats.resolution is manager.dispatcher.resolution
    report = manager.capture()  # on the CPU: nothing captured, the resolution still said
    assert report.resolution is manager.dispatcher.resolution
    assert "mode" not in str(kept.stats)  # nothing was downgraded: nothing to say
    with pytest.raises(ModeNotSupportedError, match="decode_only"):
        CUDAGraphManager(
            model,
            paged_static_inputs(layout),
            config,
            device="cpu",
            options=ManagerOptions(
                attention=AttentionOptions(support=declared, strict=True, metadata_builder=model.backend)
            ),
        )


def test_a_model_declaring_something_else_is_refused_by_name() -> None:
    class Liar(torch.nn.Module):
        def graph_support(self) -> object:
            return GraphSupport.ALWAYS

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    config = DispatchConfig(M.FULL, CaptureSizes.default(8), max_num_seqs=8)
    with pytest.raises(ValueError, match=r"model: graph_support\(\) returned"):
        CUDAGraphManager(Liar(), {}, config)


def test_a_resized_cache_serves_the_same_static_inputs() -> None:
    """``allocate_kv_cache``: more pages, the same padding (scratch page 0), still the oracle's result."""
    layout = PagedLayout.for_config(SMALL, page_size=8)
    model = PagedDecoder(SMALL, layout=layout, backend="flex", breakable=False)
    pads = {name: spec.pad_value for name, spec in paged_static_inputs(layout).items()}
    model.allocate_kv_cache(layout.num_pages + 40)
    assert model.layout.num_pages == layout.num_pages + 40
    assert all(cache.shape[1] == layout.num_pages + 40 for cache in model.kv_caches())
    assert {name: spec.pad_value for name, spec in paged_static_inputs(model.layout).items()} == pads
    for cache in model.kv_caches():
        cache.normal_()
    inputs = make_paged_inputs(
        SMALL, model.layout, 30, uniform_decode=False, generator=torch.Generator().manual_seed(8)
    )
    assert rel_err(_eager(model, inputs, False), dense_reference(model, inputs)) < 1e-5
    assert model.kv_page_bytes() == SMALL.num_layers * 2 * 8 * SMALL.hidden_size * 4 + 8 * 4
    assert isinstance(model.backend, FlexPagedAttention)
    assert model.backend.layout == model.layout
    page_of_slot = model.backend.page_of_slot
    assert torch.equal(page_of_slot, torch.arange(8 * (layout.num_pages + 40), dtype=torch.int32) // 8)
    with pytest.raises(ValueError, match=r"num_pages: expected an integer >= 2"):
        model.allocate_kv_cache(1)


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 100])
def test_each_query_tile_lists_exactly_the_distinct_pages_of_its_tokens(num_tokens: int) -> None:
    """The block mask's page lists: the compiled kernel reads only those (a missing page: a wrong result)."""
    generator = torch.Generator().manual_seed(num_tokens)
    pages = torch.randint(1, 40, (num_tokens, 3), generator=generator)
    pages[::3, 2] = 0  # the scratch page stands in for pages past a token's position
    counts, indices = tile_unions(pages, 0)
    tiles = -(-num_tokens // 16)
    assert counts.shape == (1, 1, tiles)
    assert indices.shape == (1, 1, tiles, 48)
    for tile in range(tiles):
        rows = pages[tile * 16 : (tile + 1) * 16]
        expected = set(rows.flatten().tolist()) | ({0} if rows.shape[0] < 16 else set())
        listed = indices[0, 0, tile, : int(counts[0, 0, tile])].tolist()
        assert len(listed) == len(set(listed))
        assert set(listed) == expected


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_warm_up_writes_only_the_scratch_page(backend: str) -> None:
    layout = PagedLayout.for_config(SMALL, page_size=8)
    model = PagedDecoder(SMALL, layout=layout, backend=backend)
    before = [cache.clone() for cache in model.kv_caches()]
    model.warm_up(40, query_len=2)
    for old, new in zip(before, model.kv_caches(), strict=True):
        assert torch.equal(old[:, 1:], new[:, 1:])  # every page but scratch (0) untouched
    with pytest.raises(ValueError, match="max_tokens: expected an integer >= 1"):
        model.warm_up(0)
    with pytest.raises(ValueError, match="query_len: expected an integer >= 1"):
        model.warm_up(8, query_len=0)


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: PagedDecoder("small"), "config"),  # type: ignore[arg-type]
        (lambda: PagedDecoder(SMALL, breakable="no"), "breakable"),  # type: ignore[arg-type]
        (lambda: PagedDecoder(SMALL, backend=None), "backend"),  # type: ignore[arg-type]
        (lambda: PagedDecoder(SMALL, backend="sdpa"), "backend"),
        (lambda: PagedDecoder(SMALL, layout=16), "layout"),  # type: ignore[arg-type]
        (lambda: ReferenceDecoder(SMALL, attention="sdpa"), "attention"),  # type: ignore[arg-type]
        (lambda: ReferenceDecoder(SMALL, breakable="no"), "breakable"),  # type: ignore[arg-type]
    ],
)
def test_a_wrong_argument_is_named_where_the_model_is_built(build: object, named: str) -> None:
    assert callable(build)
    with pytest.raises(ValueError, match=rf"^{named}: "):
        build()


def test_a_backend_of_another_layout_is_refused_by_name() -> None:
    other = PagedLayout.for_config(SMALL, page_size=16)
    backend = FlexPagedAttention(other, max_tokens=64, max_reqs=16)
    with pytest.raises(ValueError, match=r"^backend: its layout"):
        PagedDecoder(SMALL, layout=PagedLayout.for_config(SMALL, page_size=8), backend=backend)
    model = PagedDecoder(SMALL, layout=other, backend=backend)
    model.allocate_kv_cache(other.num_pages + 1)  # the backend given is resized, the same object
    assert model.backend is backend
    assert backend.layout == model.layout == dataclasses.replace(other, num_pages=other.num_pages + 1)


@pytest.mark.parametrize("backend", ["gather", "flex"])
@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.NONE])
def test_the_manager_builds_the_backends_metadata_on_the_cpu(backend: str, mode: CUDAGraphMode) -> None:
    """Through the seam (``AttentionOptions(metadata_builder=...)``), padded steps equal the oracle."""
    layout = PagedLayout.for_config(SMALL, page_size=8)
    model = PagedDecoder(SMALL, layout=layout, backend=backend)
    config = DispatchConfig(mode, CaptureSizes.default(32), max_num_seqs=16)
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        config,
        device="cpu",
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )
    generator = torch.Generator().manual_seed(4)
    for num_tokens, uniform in ((5, True), (13, False), (1, False), (16, True)):
        inputs = make_paged_inputs(SMALL, layout, num_tokens, uniform_decode=uniform, generator=generator)
        with torch.no_grad():
            served = manager.run_batch(inputs, uniform_decode=uniform).clone()
        assert served.shape == (num_tokens, SMALL.hidden_size)
        assert rel_err(served, dense_reference(model, inputs)) < 1e-5


def test_a_bad_step_is_refused_by_the_backend_naming_the_input() -> None:
    layout = PagedLayout.for_config(SMALL, page_size=8)
    model = PagedDecoder(SMALL, layout=layout, backend="gather")
    inputs = make_paged_inputs(
        SMALL, layout, 6, uniform_decode=False, generator=torch.Generator().manual_seed(2)
    )
    inputs["block_table"][0, 0] = layout.num_pages  # a page out of range
    with pytest.raises(ValueError, match=r"^block_table: "):
        model.step(inputs)
    with pytest.raises(ValueError, match=r"^uniform_decode: "):
        model.step(make_paged_inputs(SMALL, layout, 7, uniform_decode=False), uniform_decode=True)


# -- GPU: every mode x backend replay equals eager --

DEVICE_CONFIG: Final = DecoderConfig(num_layers=2, max_num_seqs=32, max_seq_len=512)
_MODES: Final = (M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE, M.PIECEWISE)


def _steps(config: DecoderConfig, largest: int, query_len: int, seed: int) -> Iterator[tuple[int, bool]]:
    generator = torch.Generator().manual_seed(seed)
    for i in range(24):
        uniform = i % 2 == 0
        if uniform:
            requests = int(torch.randint(1, config.max_num_seqs + 1, (), generator=generator))
            yield requests * query_len, True
        else:
            yield int(torch.randint(1, largest + 1, (), generator=generator)), False


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "gather"])
@pytest.mark.parametrize("mode", _MODES)
def test_every_replay_equals_eager_on_random_paged_layouts(backend: str, mode: CUDAGraphMode) -> None:
    config = DEVICE_CONFIG
    layout = PagedLayout.for_config(config, page_size=128)
    torch.manual_seed(11)
    model = PagedDecoder(config, layout=layout, backend=backend, device="cuda")
    dispatch = DispatchConfig(mode, CaptureSizes.default(96), max_num_seqs=config.max_num_seqs)
    # FULL_DECODE_ONLY runs mixed batches eagerly by design: strict everywhere else.
    eager_mixed = mode.mixed_mode() is M.NONE
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        dispatch,
        strict=not eager_mixed,
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )
    with torch.no_grad():
        report = manager.capture()
    assert report.num_graphs == len(list(manager.dispatcher.keys(M.FULL))) + len(
        list(manager.dispatcher.keys(M.PIECEWISE))
    )
    generator = torch.Generator().manual_seed(17)
    worst = 0.0
    with torch.no_grad():
        for num_tokens, uniform in _steps(config, 96, 1, seed=_MODES.index(mode) * 2 + (backend == "flex")):
            inputs = make_paged_inputs(
                config, layout, num_tokens, uniform_decode=uniform, generator=generator, device="cuda"
            )
            replayed = manager.run_batch(inputs, uniform_decode=uniform).clone()
            worst = max(worst, rel_err(replayed, _eager(model, inputs, uniform)))
    assert worst < 3e-2, f"{backend} {mode.name}: worst relative error {worst}"
    stats = manager.stats
    assert stats.eager_steps == (12 if eager_mixed else 0)
    assert stats.num_replays == 24 - stats.eager_steps
    if mode.decode_mode() is M.FULL:
        assert stats.replays_of(M.FULL) >= 12


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "uniform", "query_len"), [(200, False, 1), (1, False, 1), (32, True, 1), (24, True, 3)]
)
def test_the_compiled_kernel_equals_the_per_request_oracle(
    num_tokens: int, uniform: bool, query_len: int
) -> None:
    """FlexAttention's fused Triton kernel (pages of 128, 64-key blocks) against the float64 oracle.

    The GPU replay tests compare a graph with the same compiled model run
    eagerly; this one checks the kernel itself, on fresh random layouts.
    """
    config = dataclasses.replace(DEVICE_CONFIG, dtype=torch.float32)
    layout = PagedLayout.for_config(config, page_size=128)
    torch.manual_seed(21)
    model = PagedDecoder(config, layout=layout, backend="flex", device="cuda")
    generator = torch.Generator().manual_seed(num_tokens + query_len)
    for _ in range(2):
        inputs = make_paged_inputs(
            config,
            layout,
            num_tokens,
            uniform_decode=uniform,
            query_len=query_len,
            generator=generator,
            device="cuda",
        )
        with highest_fp32_matmul_precision():
            assert rel_err(_eager(model, inputs, uniform), dense_reference(model, inputs)) < 1e-3


@pytest.mark.gpu
def test_spec_decode_under_a_single_token_level_never_replays_full() -> None:
    """A backend declared UNIFORM_SINGLE_TOKEN_DECODE, q = 3: FULL resolves to PIECEWISE, steps stay right."""
    config = DEVICE_CONFIG
    layout = PagedLayout.for_config(config, page_size=128)
    torch.manual_seed(13)
    declared = AttentionSupport(GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, name="decode_only_flex")
    model = PagedDecoder(config, layout=layout, backend="flex", device="cuda")
    dispatch = DispatchConfig(M.FULL, CaptureSizes.default(96), max_num_seqs=32, uniform_decode_query_len=3)
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        dispatch,
        strict=True,
        options=ManagerOptions(
            # the flex kernel, declared at a decode-only kernel's level
            attention=AttentionOptions(support=declared, metadata_builder=model.backend)
        ),
    )
    assert manager.dispatcher.resolution.mode is M.PIECEWISE
    with torch.no_grad():
        manager.capture()
    generator = torch.Generator().manual_seed(19)
    with torch.no_grad():
        for requests in (1, 5, 16, 32):
            inputs = make_paged_inputs(
                config,
                layout,
                3 * requests,
                uniform_decode=True,
                query_len=3,
                generator=generator,
                device="cuda",
            )
            replayed = manager.run_batch(inputs, uniform_decode=True).clone()
            assert rel_err(replayed, _eager(model, inputs, True)) < 3e-2
    assert manager.stats.replays_of(M.FULL) == 0
    assert manager.stats.replays_of(M.PIECEWISE) == 4
