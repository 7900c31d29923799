"""Idle steps never give the model empty inputs; a refused step is never counted.

Issue 39: an empty first step of the paged decoder (a fresh CPU manager, or
after ``capture()``) called the model on empty inputs and crashed, though an
idle step does not call the model; and on every path without a graph (no
CUDA, above the largest size, not captured) a step was counted in
``eager_steps``/``eager_reasons`` before its builder refused it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, Generic, TypeVar

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions
from examples import DecoderConfig
from examples.inputs import make_paged_inputs
from examples.paged import PagedDecoder, PagedLayout, paged_static_inputs
from tests.manager.helpers import (
    INPUTS,
    SIZES,
    DictModel,
    FakeEngines,
    ToyModel,
    as_tensor_dict,
    config_for,
    make_batch,
)
from tests.manager.test_attention_seam import INPUTS as SEAM_INPUTS
from tests.manager.test_attention_seam import SeamModel, ToyBuilder
from tests.manager.test_attention_seam import _batch as seam_batch
from tests.torch_support import eager_flex_is_expected as eager_flex_is_expected  # autouse

R = TypeVar("R")
CPU: Final = torch.device("cpu")
M: Final = CUDAGraphMode
SMALL: Final = DecoderConfig.small()


class Calls(Generic[R]):
    """Wraps a model: the token count of every call (an empty one is the bug)."""

    def __init__(self, model: Callable[..., R], tokens: str) -> None:
        self.model = model
        self.tokens = tokens
        self.counts: list[int] = []

    def __call__(self, **inputs: torch.Tensor) -> R:
        self.counts.append(int(inputs[self.tokens].shape[0]))
        return self.model(**inputs)


def _empty(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step with no token: every batched input cut to 0 rows (an unbatched one kept)."""
    return {name: t[:0] if name != "bias" else t for name, t in inputs.items()}


# -- idle steps --


def _paged_manager(
    *, fakes: bool, strict: bool = False
) -> tuple[CUDAGraphManager[torch.Tensor], Calls[torch.Tensor], PagedLayout]:
    layout = PagedLayout.for_config(SMALL, page_size=8)
    model = PagedDecoder(SMALL, layout=layout, backend="gather")
    calls = Calls(model, "input_ids")
    config = DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes.default(32), max_num_seqs=16)
    manager = CUDAGraphManager(
        calls,
        paged_static_inputs(layout),
        config,
        device="cpu",
        strict=strict,
        options=ManagerOptions(
            engine_factory=FakeEngines() if fakes else None,
            attention=AttentionOptions(metadata_builder=model.backend),
        ),
    )
    return manager, calls, layout


@pytest.mark.parametrize(
    ("fakes", "strict", "captured"),
    [
        (False, False, False),
        (False, False, True),
        (True, False, False),
        (True, True, True),
        (True, False, True),
    ],
    ids=["no-cuda-fresh", "no-cuda-after-capture", "fakes-fresh", "fakes-strict-captured", "fakes-captured"],
)
@pytest.mark.parametrize("uniform", [False, True])
def test_an_idle_paged_step_never_calls_the_model_on_empty_inputs(
    fakes: bool, strict: bool, captured: bool, uniform: bool
) -> None:
    manager, calls, layout = _paged_manager(fakes=fakes, strict=strict)
    if captured:
        manager.capture(progress=False)
    empty = {n: torch.zeros((0, *s.shape), dtype=s.dtype) for n, s in paged_static_inputs(layout).items()}
    for _ in range(2):
        out = manager.run_batch(empty, uniform_decode=uniform)
        assert out.shape == (0, SMALL.hidden_size)
    assert 0 not in calls.counts, calls.counts
    calls_before = len(calls.counts)
    manager.run_batch(empty)
    assert len(calls.counts) == calls_before  # the structure is known: no call at all
    stats = manager.stats
    assert (stats.idle_steps, stats.eager_steps, stats.num_replays) == (3, 0, 0)
    inputs = make_paged_inputs(
        SMALL, layout, 5, uniform_decode=False, generator=torch.Generator().manual_seed(1)
    )
    assert manager.run_batch(inputs).shape == (5, SMALL.hidden_size)  # a real step after them


@pytest.mark.parametrize("fakes", [False, True], ids=["no-cuda", "fakes"])
@pytest.mark.parametrize("captured", [False, True], ids=["fresh", "captured"])
def test_an_idle_step_of_a_dict_model_has_its_structure_without_an_empty_call(
    fakes: bool, captured: bool
) -> None:
    calls = Calls(DictModel(CPU), "ids")
    manager = CUDAGraphManager(
        calls,
        INPUTS,
        config_for(M.FULL),
        device="cpu",
        options=ManagerOptions(
            engine_factory=FakeEngines() if fakes else None, output_rows=DictModel.OUTPUT_ROWS
        ),
    )
    if captured:
        manager.capture(progress=False)
    for seed in range(2):
        out = as_tensor_dict(manager.run_batch(_empty(make_batch(1, 1, CPU, seed=seed))))
        assert set(out) == {"hidden", "per_req", "bias2"}
        assert out["hidden"].shape == (0, 32)
        assert out["per_req"].shape == (0,)
        assert out["bias2"].shape == (32,)
        assert not out["bias2"].any()  # an unbatched output of an idle step is zero, every time
    assert 0 not in calls.counts, calls.counts
    assert manager.stats.idle_steps == 2
    assert manager.stats.eager_steps == 0


def test_a_fresh_toy_manager_learns_its_outputs_from_one_padding_row() -> None:
    calls = Calls(ToyModel(CPU), "ids")
    manager = CUDAGraphManager(calls, INPUTS, config_for(M.FULL), device="cpu")
    assert manager.run_batch(_empty(make_batch(1, 1, CPU, seed=0))).shape == (0, 32)
    assert calls.counts == [1]  # once, on one padding row, never on 0 rows
    assert manager.run_batch(_empty(make_batch(1, 1, CPU, seed=1))).shape == (0, 32)
    assert calls.counts == [1]


# -- refused steps count nothing --

#: Where a step runs without a graph: (fake engines?, captured?, tokens) -- no CUDA, not captured,
#: above the largest size.
PATHS: Final = {
    "no_cuda": (False, False, 5),
    "not_captured": (True, False, 5),
    "above_largest": (True, True, max(SIZES) + 3),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_step_the_seams_builder_refuses_is_not_counted(path: str) -> None:
    fakes, captured, _ = PATHS[path]
    builder = ToyBuilder()
    manager = CUDAGraphManager(
        SeamModel(builder),
        SEAM_INPUTS,
        config_for(M.FULL, sizes=(1, 2, 4, 8), max_num_seqs=16),
        device="cpu",
        options=ManagerOptions(
            engine_factory=FakeEngines() if fakes else None,
            attention=AttentionOptions(metadata_builder=builder),
        ),
    )
    if captured:
        manager.capture(progress=False)
    tokens = 12 if path == "above_largest" else 5
    stats = manager.stats
    builder.refuse = True
    with pytest.raises(ValueError, match=r"^scale: refused by the builder"):
        manager.run_batch(seam_batch(tokens, 3, seed=1))
    assert manager.stats == stats
    builder.refuse = False
    manager.run_batch(seam_batch(tokens, 3, seed=2))
    assert manager.stats.eager_steps == stats.eager_steps + 1  # an accepted one is counted


@pytest.mark.parametrize("path", list(PATHS))
def test_a_step_the_paged_builder_refuses_is_not_counted(path: str) -> None:
    fakes, captured, tokens = PATHS[path]
    manager, calls, layout = _paged_manager(fakes=fakes)
    if captured:
        manager.capture(progress=False)
    tokens = 40 if path == "above_largest" else tokens  # the config's largest size is 32
    generator = torch.Generator().manual_seed(3)
    bad = make_paged_inputs(SMALL, layout, tokens, uniform_decode=False, generator=generator)
    bad["block_table"][0, 0] = layout.num_pages  # a page out of range
    stats = manager.stats
    called = len(calls.counts)
    with pytest.raises(ValueError, match=r"^block_table: "):
        manager.run_batch(bad)
    assert manager.stats == stats
    assert len(calls.counts) == called  # refused before the model
    good = make_paged_inputs(SMALL, layout, tokens, uniform_decode=False, generator=generator)
    manager.run_batch(good)
    assert manager.stats.eager_steps == stats.eager_steps + 1
