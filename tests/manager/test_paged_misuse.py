"""The paged example refuses what no paged cache can serve, naming the input (issue 39).

On the CPU (and on eager steps) a bad step raises at once; on a graph path
of a device the backend records it without synchronizing and
``PagedDecoder.check_steps()`` reports it (GPU tests). ``allocate_kv_cache``
is all or nothing; an empty batch builds its metadata as padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch
from examples import DecoderConfig
from examples.inputs import make_paged_inputs
from examples.paged import (
    FlexMetadata,
    GatherMetadata,
    GatherPagedAttention,
    PagedBuffers,
    PagedDecoder,
    PagedLayout,
    paged_static_inputs,
)
from examples.paged.batch import Validate
from examples.paged.checks import DeviceChecks
from tests.manager.oracles import dense_reference
from tests.torch_support import eager_flex_is_expected as eager_flex_is_expected  # autouse
from tests.torch_support import rel_err

SMALL: Final = DecoderConfig.small()
LAYOUT: Final = PagedLayout.for_config(SMALL, page_size=8)
Inputs = dict[str, torch.Tensor]


def _inputs(num_tokens: int, *, uniform: bool = False, query_len: int = 1, seed: int = 3) -> Inputs:
    generator = torch.Generator().manual_seed(seed)
    return make_paged_inputs(
        SMALL, LAYOUT, num_tokens, uniform_decode=uniform, query_len=query_len, generator=generator
    )


def _two_decodes() -> Inputs:
    """Two one-token requests, on pages 1-2 and 3-4, at positions 9 and 12."""
    table = torch.zeros(2, LAYOUT.pages_per_seq, dtype=torch.int32)
    table[0, :2], table[1, :2] = torch.tensor([1, 2]), torch.tensor([3, 4])
    return {
        "input_ids": torch.tensor([5, 6]),
        "positions": torch.tensor([9, 12]),
        "slot_mapping": torch.tensor([2 * 8 + 1, 4 * 8 + 4]),
        "query_lens": torch.tensor([1, 1], dtype=torch.int32),
        "seq_lens": torch.tensor([10, 13], dtype=torch.int32),
        "block_table": table,
    }


def _same_slot(inputs: Inputs) -> None:
    """Both requests on the same pages, at the same position: two tokens write one slot."""
    inputs["block_table"][1] = inputs["block_table"][0]
    inputs["positions"][1], inputs["seq_lens"][1] = 9, 10
    inputs["slot_mapping"][1] = inputs["slot_mapping"][0]


def _page_twice(inputs: Inputs) -> None:
    inputs["block_table"][0, 1] = inputs["block_table"][0, 0]
    inputs["slot_mapping"][0] = int(inputs["block_table"][0, 0]) * 8 + 1


#: A valid two-request step altered, and the error's start: each names its input.
BAD_STEPS: Final[list[tuple[str, Callable[[Inputs], None], str]]] = [
    (
        "id-vocab",
        lambda i: i["input_ids"].__setitem__(0, SMALL.vocab_size),
        r"^input_ids: .*\[0, 512\).* \[512\]",
    ),
    ("id-negative", lambda i: i["input_ids"].__setitem__(1, -1), r"^input_ids: .*got \[-1\]"),
    ("slot-twice", _same_slot, r"^slot_mapping: each token writes a slot of its own"),
    ("page-twice", _page_twice, r"^block_table: a request's used pages are distinct"),
    ("page-scratch", lambda i: i["block_table"].__setitem__((0, 0), 0), r"^block_table: .*scratch"),
    ("position", lambda i: i["positions"].__setitem__(0, 3), r"^positions: "),
]


@pytest.mark.parametrize(("alter", "pattern"), [pytest.param(a, p, id=n) for n, a, p in BAD_STEPS])
@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_a_bad_step_is_named_eagerly_and_through_the_manager(
    backend: str, alter: Callable[[Inputs], None], pattern: str
) -> None:
    model = PagedDecoder(SMALL, layout=LAYOUT, backend=backend)
    good = _two_decodes()
    with torch.no_grad():
        assert rel_err(model.step(good), dense_reference(model, good)) < 1e-5  # the step is valid
    bad = {name: t.clone() for name, t in good.items()}
    alter(bad)
    with pytest.raises(ValueError, match=pattern):
        model.step(bad)
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(LAYOUT),
        DispatchConfig(CUDAGraphMode.NONE, CaptureSizes([8]), max_num_seqs=16),
        device="cpu",
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )
    with torch.no_grad(), pytest.raises(ValueError, match=pattern):
        manager.run_batch(bad)


def test_a_uniform_batch_whose_query_lens_are_not_q_is_refused() -> None:
    """Issue 39: q=2, 3 requests of 6 tokens as 1, 2 and 3 ran on offsets 0, 2, 4, 6."""
    model = PagedDecoder(SMALL, layout=LAYOUT, backend="gather")
    uneven = _inputs(6, uniform=True, query_len=2)  # 3 requests of 2 tokens
    uneven["query_lens"] = torch.tensor([1, 2, 3], dtype=torch.int32)  # still 6 tokens
    with pytest.raises(ValueError, match=r"^query_lens: a uniform batch .*\(2\)"):
        model.step(uneven, uniform_decode=True)
    buffers = PagedBuffers(LAYOUT, max_tokens=16, max_reqs=8, device="cpu")
    shape = BatchShape(8, 4, 2, CUDAGraphMode.FULL)  # on the CPU a graph's shape is checked at once too
    with pytest.raises(ValueError, match=r"^query_lens: a uniform batch"):
        buffers.fill(StepBatch(6, 3, uneven, uniform_decode=True), shape)


def test_validate_takes_eager_device_host_or_a_bool() -> None:
    for mode in ("eager", "device", "host", True, False):
        PagedBuffers(LAYOUT, max_tokens=8, max_reqs=4, device="cpu", validate=mode)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"^validate: expected 'eager', 'device', 'host', True or False"):
            PagedBuffers(LAYOUT, max_tokens=8, max_reqs=4, device="cpu", validate=bad)  # type: ignore[arg-type]


def test_for_config_names_a_config_without_its_limits() -> None:
    with pytest.raises(ValueError, match=r"^config: expected .*max_num_seqs and max_seq_len.*'small'"):
        PagedLayout.for_config("small")  # type: ignore[arg-type]  # the misuse under test


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_a_failed_allocation_leaves_the_model_serving(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: ``allocate_kv_cache(2**40)`` resized the layout, then torch failed: every step IndexError."""
    model = PagedDecoder(SMALL, layout=LAYOUT, backend=backend)
    before = [cache.data_ptr() for cache in model.kv_caches()]
    for num_pages in (2**40, 3 * 10**12):  # beyond any memory: refused before a cache is dropped
        with pytest.raises(
            ValueError, match=rf"^num_pages: {num_pages} pages need \d+ bytes .*nothing was changed"
        ):
            model.allocate_kv_cache(num_pages)
    assert model.layout == LAYOUT
    assert [cache.data_ptr() for cache in model.kv_caches()] == before  # graphs reading them stay valid
    resize = type(model.backend).resize  # type: ignore[attr-defined]  # both backends resize

    def failing(self: object, num_pages: int) -> None:
        raise RuntimeError("out of memory (the backend's buffers)")

    monkeypatch.setattr(type(model.backend), "resize", failing)
    with pytest.raises(
        RuntimeError, match=r"^num_pages: \d+ pages could not be allocated .*the backend's buffers"
    ):
        model.allocate_kv_cache(LAYOUT.num_pages + 8)
    monkeypatch.setattr(type(model.backend), "resize", resize)
    assert model.layout == LAYOUT
    assert all(cache.shape[1] == LAYOUT.num_pages for cache in model.kv_caches())
    for cache in model.kv_caches():
        cache.normal_()
    inputs = _inputs(20)
    with torch.no_grad():
        assert rel_err(model.step(inputs), dense_reference(model, inputs)) < 1e-5


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_an_empty_batch_builds_padding(backend: str) -> None:
    """If a manager routes an idle step to the builder, its metadata is all padding."""
    model = PagedDecoder(SMALL, layout=LAYOUT, backend=backend)
    empty = {
        name: torch.zeros((0, *spec.shape), dtype=spec.dtype)
        for name, spec in paged_static_inputs(LAYOUT).items()
    }
    for shape in (BatchShape.eager(0, 0, False), BatchShape(8, 8, None, CUDAGraphMode.FULL)):
        meta = model.backend.build(StepBatch(0, 0, empty), shape)
        assert isinstance(meta, (GatherMetadata, FlexMetadata))
        paged = meta.paged
        assert paged.query_start_loc.tolist() == [0] + [shape.num_tokens] * shape.num_reqs
        assert (paged.req_ids == -1).all()


# -- GPU: a graph path records a bad step on the device; check_steps() reports it --


def _cuda_manager(validate: Validate) -> tuple[CUDAGraphManager[torch.Tensor], PagedDecoder]:
    """A captured FULL_AND_PIECEWISE manager of SMALL's decoder on the GPU; gather's ``validate``."""
    backend = GatherPagedAttention(
        LAYOUT, SMALL.dtype, max_tokens=16 * LAYOUT.max_seq_len, max_reqs=16, device="cuda", validate=validate
    )
    model = PagedDecoder(SMALL, layout=LAYOUT, backend=backend, device="cuda")
    layout = LAYOUT
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        DispatchConfig(CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes([1, 2, 4, 8, 16]), max_num_seqs=16),
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )
    manager.capture()
    return manager, model


@pytest.mark.gpu
@pytest.mark.parametrize("uniform", [True, False], ids=["full", "piecewise"])
@pytest.mark.parametrize(
    "alter", [a for n, a, _ in BAD_STEPS if n in ("slot-twice", "page-twice", "position")]
)
def test_a_bad_step_on_a_graph_is_reported_at_the_next_check(
    uniform: bool, alter: Callable[[Inputs], None]
) -> None:
    manager, model = _cuda_manager("device")
    good = {name: t.cuda() for name, t in _two_decodes().items()}
    bad = {name: t.clone() for name, t in good.items()}
    alter(bad)
    with torch.no_grad():
        manager.run_batch(good, uniform_decode=uniform)
        model.check_steps()  # nothing recorded
        manager.run_batch(bad, uniform_decode=uniform)  # no synchronization: recorded on the device
        replays = sum(manager.stats.replays.values())
        assert replays == 2, manager.stats
        with pytest.raises(ValueError, match=r"^a step run on a graph since the last check: "):
            model.check_steps()
        model.check_steps()  # reported once: cleared
        manager.run_batch(good, uniform_decode=uniform)
    model.check_steps()


@pytest.mark.gpu
def test_the_default_validation_leaves_a_graph_path_unchecked() -> None:
    """``validate=True`` ("eager"): a graph path's step costs no check, so a bad one is not recorded."""
    manager, model = _cuda_manager(True)
    bad = {name: t.cuda() for name, t in _two_decodes().items()}
    _page_twice(bad)
    with torch.no_grad():
        manager.run_batch(bad, uniform_decode=True)
    assert sum(manager.stats.replays.values()) == 1, manager.stats
    model.check_steps()  # nothing recorded


@pytest.mark.gpu
def test_host_validation_refuses_a_graph_path_step_at_once() -> None:
    manager, _ = _cuda_manager("host")
    bad = {name: t.cuda() for name, t in _two_decodes().items()}
    _page_twice(bad)
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"^block_table: a request's used pages are distinct"),
    ):
        manager.run_batch(bad, uniform_decode=True)


def test_device_checks_record_a_bad_step_until_checked() -> None:
    """The graph path's recording, on the CPU's tensors (the same ops a device runs, no synchronization)."""
    checks = DeviceChecks(LAYOUT, "cpu")
    good, bad = _two_decodes(), _two_decodes()
    _page_twice(bad)
    shape = BatchShape(2, 2, 1, CUDAGraphMode.FULL)
    checks.record(StepBatch(2, 2, good), shape)
    checks.check()
    checks.record(StepBatch(2, 2, bad), shape)
    checks.record(StepBatch(2, 2, good), shape)  # a later good step does not clear it
    with pytest.raises(
        ValueError, match=r"^a step run on a graph since the last check: block_table: .*twice"
    ):
        checks.check()
    checks.check()  # cleared once reported
