"""Encoder graphs keyed by token budget, on a GPU (docs/design.md, "Encoder graphs").

FULL graphs of the example ViT (``examples.encoder``), one per budget, in one
``CUDAGraphManager``: every budget replayed, random mixes of items, each
item's output compared with the item run alone eagerly (relative L2 error;
a mismatch is an item above the tolerance), background capture while
serving, the report, the estimate, release and wake.
"""

from __future__ import annotations

import random
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.budgets import TokenBudgets
from cudagraph_manager.attention import BatchShape
from examples.encoder import EncoderConfig, EncoderRunner, random_items
from examples.encoder.model import Kernel

pytestmark = pytest.mark.gpu

_FULL: Final = CUDAGraphMode.FULL
#: Relative L2 error per item: bf16 packed against bf16 alone (other GEMM shapes), fp32 with the mask.
_RTOL: Final = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _config(kernel: Kernel) -> EncoderConfig:
    """Four blocks 256 wide: bf16 for varlen, fp32 for the mask (a tight comparison)."""
    dtype = torch.bfloat16 if kernel == "varlen" else torch.float32
    return EncoderConfig(patch_dim=192, hidden=256, heads=4, layers=4, max_positions=1024, dtype=dtype)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _mismatches(runner: EncoderRunner, lengths: list[int], seed: int) -> list[tuple[int, float]]:
    """``(length, error)`` of each item whose packed output is off the item alone (none, if right)."""
    config = runner.model.config
    items = random_items(config, lengths, torch.Generator().manual_seed(seed), runner.device)
    outputs = runner.encode(items)
    errors = [
        (item.shape[0], _relative_error(out, runner.encode_alone(item)))
        for item, out in zip(items, outputs, strict=True)
    ]
    return [(n, e) for n, e in errors if not e <= _RTOL[config.dtype]]


def _mixes(seed: int, count: int, smallest: int, largest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(smallest, largest) for _ in range(rng.randint(1, 8))] for _ in range(count)]


@pytest.mark.parametrize("kernel", ["varlen", "masked"])
def test_every_budget_replays_each_item_as_alone(kernel: Kernel) -> None:
    budgets = TokenBudgets.default(2048, max_items=8)
    runner = EncoderRunner(_config(kernel), budgets, kernel=kernel, strict=True)  # strict: every pack replays
    report = runner.manager.capture()
    assert report.num_graphs == len(budgets.budgets)
    below = 0
    for budget in budgets.budgets:
        assert _mismatches(runner, [budget], budget) == []  # fills the budget: no padding
        assert _mismatches(runner, [below + 1], budget + 1) == []  # just above the budget below
        assert _mismatches(runner, [1, budget - 2] if budget > 2 else [1], budget + 2) == []
        below = budget
    for seed, lengths in enumerate(_mixes(0, 24, 1, 1024)):  # 1-8 items, some split into several packs
        assert _mismatches(runner, lengths, 100 + seed) == [], lengths
    stats = runner.manager.stats
    assert stats.eager_steps == 0
    assert stats.replays_of(_FULL) > 0


def test_the_issues_vit_equals_each_item_alone() -> None:
    """12 blocks, 768 wide, bf16, varlen: mixes of 1-8 items of 64-1024 patches, 0 mismatches."""
    budgets = TokenBudgets.default(8192, max_items=8)
    runner = EncoderRunner(EncoderConfig(), budgets, strict=True)
    assert runner.model.kernel == "varlen"
    runner.manager.capture()
    for seed, lengths in enumerate(_mixes(1, 12, 64, 1024)):
        assert _mismatches(runner, lengths, seed) == [], lengths
    assert runner.manager.stats.eager_steps == 0


def test_a_replay_equals_the_same_pack_run_eagerly() -> None:
    """The graph against the unpadded pack run eagerly (the benchmark's baseline)."""
    budgets = TokenBudgets.default(2048, max_items=8)
    runner = EncoderRunner(_config("varlen"), budgets, strict=True)
    runner.manager.capture()
    for seed, lengths in enumerate(_mixes(2, 8, 64, 1024)):
        items = random_items(runner.model.config, lengths, torch.Generator().manual_seed(seed), runner.device)
        for out, ref in zip(runner.encode(items), runner.encode_eager(items), strict=True):
            assert _relative_error(out, ref) <= _RTOL[torch.bfloat16]


def test_each_replay_writes_its_offsets_in_the_graph() -> None:
    """A replay's build launches nothing: the graph's own cumsum writes the offsets each replay reads."""
    budgets = TokenBudgets([256, 1024], max_items=4)
    runner = EncoderRunner(_config("varlen"), budgets, strict=True)
    runner.manager.capture()
    view = runner.builder.build_for_capture(BatchShape(1024, 4, None, _FULL)).offsets
    rng = random.Random(5)
    for seed in range(12):  # 1-4 items in the 1024 budget (over 256 tokens), after packs of every count
        count = rng.randint(1, 4)
        lengths = [rng.randint(260 // count + 1, 1024 // count) for _ in range(count)]
        items = random_items(runner.model.config, lengths, torch.Generator().manual_seed(seed), runner.device)
        outputs = runner.encode(items)
        ends = [sum(lengths[: i + 1]) for i in range(count)]
        expected = [0, *ends, *[sum(lengths)] * (4 - count), 1024]
        assert view.tolist() == expected, lengths  # written by the replay: empty sequences, then padding
        for item, out in zip(items, outputs, strict=True):  # (an item alone runs eagerly, after the check)
            assert _relative_error(out, runner.encode_alone(item)) <= _RTOL[torch.bfloat16], lengths
    assert runner.manager.stats.eager_steps == 0


def test_background_capture_serves_every_item_as_alone() -> None:
    budgets = TokenBudgets.default(2048, max_items=8)
    runner = EncoderRunner(_config("varlen"), budgets)
    handle = runner.manager.start_capture()
    for seed, lengths in enumerate(_mixes(3, 10, 64, 1024)):  # while it captures: eager or replayed
        assert _mismatches(runner, lengths, seed) == [], lengths
    handle.wait(300)
    assert handle.done
    assert not handle.errors
    assert runner.manager.num_captured == len(budgets.budgets)
    replays = runner.manager.stats.replays_of(_FULL)
    for seed, lengths in enumerate(_mixes(4, 6, 64, 1024)):
        assert _mismatches(runner, lengths, 50 + seed) == [], lengths
    assert runner.manager.stats.replays_of(_FULL) > replays


def test_report_estimate_release_and_wake() -> None:
    budgets = TokenBudgets.default(1024, max_items=4)
    runner = EncoderRunner(_config("varlen"), budgets)
    manager = runner.manager
    estimate = manager.estimate_memory()
    assert estimate.no_graphs is None
    assert estimate.total_bytes > 0
    report = manager.capture()
    assert sorted(g.descriptor.num_tokens for g in report.graphs) == list(budgets.budgets)
    assert {g.descriptor.num_reqs for g in report.graphs} == {min(b, 4) for b in budgets.budgets}
    assert _mismatches(runner, [300, 200], 0) == []
    manager.release()
    assert _mismatches(runner, [300, 200], 1) == []  # released: eager, still right
    assert manager.stats.eager_reasons.get("released", 0) >= 1
    manager.capture()  # the wake
    replays = manager.stats.replays_of(_FULL)
    assert _mismatches(runner, [700, 64], 2) == []
    assert manager.stats.replays_of(_FULL) == replays + 1
