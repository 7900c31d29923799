"""Encoder graphs keyed by token budget, on the CPU (docs/design.md, "Encoder graphs").

``PackedMetadataBuilder``: offsets padded with the padded total (the padding
one extra sequence), ``max_seqlen`` the shape's bound, one buffer allocated
once. The example encoder (``examples.encoder``) through one manager: without
CUDA (every pack eager, padded to its budget), and on the tests' fake engines
(the graph path: captures, replays with the metadata baked at capture,
background capture, release and wake); every item equals the item alone.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.budgets import TokenBudgets
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import (
    AttentionOptions,
    BatchShape,
    PackedMetadataBuilder,
    StepBatch,
)
from examples.encoder import EncoderConfig, EncoderRunner, encoder_static_inputs, random_items
from examples.encoder.model import ViTEncoder
from tests.manager.helpers import FakeEngines

_FULL = CUDAGraphMode.FULL
_BUDGETS = TokenBudgets([16, 32, 64, 128], max_items=4)


def _lens(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# -- the builder --


def test_offsets_end_with_the_padded_total_as_one_extra_sequence() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    shape = BatchShape(64, 4, None, _FULL)
    meta = builder.build(StepBatch(37, 3, {"item_lens": _lens(5, 20, 12)}), shape)
    offsets = meta.write_offsets(_lens(5, 20, 12, 0))  # the forward's static input: padding rows 0
    assert offsets is meta.cu_seqlens
    assert offsets.tolist() == [0, 5, 25, 37, 37, 64]  # 3 items, one empty, the padding of 27 last
    assert offsets.dtype == torch.int32
    assert meta.max_seqlen == 64  # the shape's bound: the padding's 27 and every item within it


def test_a_full_pack_still_has_its_padding_sequence() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    meta = builder.build(StepBatch(30, 4, {"item_lens": _lens(5, 5, 10, 10)}), BatchShape(32, 4, None, _FULL))
    assert meta.write_offsets(_lens(5, 5, 10, 10)).tolist() == [0, 5, 10, 20, 30, 32]


def test_a_warm_ups_batch_is_all_padding() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    meta = builder.build(StepBatch.padding(), BatchShape(128, 4, None, _FULL))
    assert meta.write_offsets(_lens(0, 0, 0, 0)).tolist() == [0, 0, 0, 0, 0, 128]


def test_build_writes_nothing_the_forward_writes_the_offsets() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    shape = BatchShape(64, 4, None, _FULL)
    meta = builder.build_for_capture(shape)
    meta.offsets.fill_(-1)  # what a replay's build would overwrite, were it to launch anything
    assert builder.build(StepBatch(7, 2, {"item_lens": _lens(3, 4)}), shape) is meta
    assert meta.offsets.tolist() == [-1] * 6


# torch 2.11's profiler warns once per process that it keeps one cycle's events (this test reads one).
@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")
def test_a_graph_shapes_build_runs_no_torch_op() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    shape = BatchShape(64, 4, None, _FULL)
    builder.build_for_capture(shape)  # the capture's: the view is made once
    batch = StepBatch(37, 3, {"item_lens": _lens(5, 20, 12)})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        builder.build(batch, shape)
    assert [e.name for e in profile.events() if e.name.startswith("aten::")] == []


@pytest.mark.parametrize("seed", range(5))
def test_offsets_are_right_for_random_item_mixes(seed: int) -> None:
    rng = random.Random(seed)
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    for _ in range(50):
        rows = rng.randint(1, _BUDGETS.max_items)
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(0, rows))]
        real = sum(lengths)
        padded = _BUDGETS.budget_for(max(real, 1)) or 0
        meta = builder.build(
            StepBatch(real, len(lengths), {"item_lens": _lens(*lengths)}),
            BatchShape(padded, rows, None, _FULL),
        )
        stale = [rng.randint(0, 200) for _ in range(rows)]
        meta.write_offsets(_lens(*stale))  # a previous step's values: overwritten below
        offsets = meta.write_offsets(_lens(*lengths, *[0] * (rows - len(lengths)))).tolist()
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        assert offsets == [0, *ends, *[real] * (rows - len(lengths)), padded]


def test_stale_or_nonzero_padding_rows_never_pass_the_padded_total() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    meta = builder.build_for_capture(BatchShape(32, 4, None, _FULL))
    assert meta.write_offsets(_lens(10, 12, 50, 50)).tolist() == [0, 10, 22, 32, 32, 32]
    rng = random.Random(11)
    for _ in range(200):  # any rows a warm-up or an earlier step left, at every budget and item count
        budget = rng.choice(_BUDGETS.budgets)
        rows = rng.randint(1, _BUDGETS.max_items)
        meta = builder.build_for_capture(BatchShape(budget, rows, None, _FULL))
        stale = [rng.randint(0, 3 * budget) for _ in range(rows)]
        offsets = meta.write_offsets(_lens(*stale)).tolist()
        ends = [min(sum(stale[: i + 1]), budget) for i in range(rows)]
        assert offsets == [0, *ends, budget], (budget, stale)


def test_offsets_of_an_eager_shape_and_one_view_per_graph_shape() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    shape = BatchShape(32, 4, None, _FULL)
    captured = builder.build_for_capture(shape)
    built = builder.build(StepBatch(7, 2, {"item_lens": _lens(3, 4)}), shape)
    assert built is captured  # the graph reads the view its capture saw
    big = builder.build_for_capture(BatchShape(128, 4, None, _FULL))
    assert big.offsets.data_ptr() == captured.offsets.data_ptr()  # one buffer, at the largest
    eager = BatchShape.eager(7, 2, False)
    first = builder.build(StepBatch(7, 2, {"item_lens": _lens(3, 4)}), eager)
    assert first.write_offsets(_lens(3, 4)).tolist() == [0, 3, 7, 7]
    assert first.max_seqlen == 7
    assert builder.build_for_capture(eager) is not first  # eager shapes are not kept (any count)


@pytest.mark.parametrize("lengths", [torch.zeros(3, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.int32)])
def test_lengths_of_another_item_count_than_the_shape_are_named(lengths: torch.Tensor) -> None:
    meta = PackedMetadataBuilder(_BUDGETS, device="cpu").build_for_capture(BatchShape(32, 4, None, _FULL))
    before = meta.offsets.tolist()
    with pytest.raises(ValueError, match=r"lengths: expected 4 item lengths"):
        meta.write_offsets(lengths)
    assert meta.offsets.tolist() == before  # refused before a row is written


def test_the_builder_validates_on_request_and_names_what_is_wrong() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu", validate=True)
    shape = BatchShape(32, 4, None, _FULL)
    with pytest.raises(ValueError, match=r"item_lens: expected lengths >= 1 summing to the 9 tokens"):
        builder.build(StepBatch(9, 2, {"item_lens": _lens(3, 4)}), shape)
    with pytest.raises(ValueError, match=r"item_lens: the step has no input"):
        builder.build(StepBatch(9, 2, {"other": _lens(3, 6)}), shape)
    with pytest.raises(ValueError, match=r"shape: 8 items exceed max_items=4"):
        builder.build_for_capture(BatchShape(32, 8, None, _FULL))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budgets": [64]}, r"budgets: expected TokenBudgets"),
        ({"budgets": _BUDGETS, "lengths": ""}, r"lengths: expected an input name"),
        ({"budgets": _BUDGETS, "validate": "yes"}, r"validate: expected True or False"),
    ],
)
def test_bad_builder_arguments_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PackedMetadataBuilder(**kwargs)  # type: ignore[arg-type]  # bad values on purpose


# -- the encoder through one manager --


def _mixes(seed: int, count: int, largest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1, largest) for _ in range(rng.randint(1, 8))] for _ in range(count)]


def _assert_each_item_as_alone(runner: EncoderRunner, lengths: list[int], seed: int) -> None:
    items = random_items(runner.model.config, lengths, torch.Generator().manual_seed(seed), runner.device)
    outputs = runner.encode(items)
    assert [o.shape for o in outputs] == [(n, runner.model.config.hidden) for n in lengths]
    for item, out in zip(items, outputs, strict=True):
        torch.testing.assert_close(out, runner.encode_alone(item), rtol=1e-4, atol=1e-4)


def test_without_cuda_every_pack_runs_eagerly_padded_to_its_budget() -> None:
    runner = EncoderRunner(EncoderConfig.small(), _BUDGETS, device="cpu")
    report = runner.manager.capture()
    assert report.no_graphs is not None
    for seed, lengths in enumerate(_mixes(0, 6, 128)):
        _assert_each_item_as_alone(runner, lengths, seed)
    stats = runner.manager.stats
    assert dict(stats.eager_reasons) == {"no_cuda": stats.eager_steps}
    assert stats.padded_tokens > 0  # each pack ran padded to its budget


def test_the_eager_baseline_and_oracle_are_steps_of_a_manager_without_graphs() -> None:
    """``encode_eager`` and ``encode_alone`` are ``eager_manager``'s eager steps: unpadded, counted there."""
    runner = EncoderRunner(EncoderConfig.small(), _BUDGETS, device="cpu")
    items = random_items(runner.model.config, [5, 9, 20], torch.Generator().manual_seed(3), "cpu")
    packed = runner.encode_eager(items)  # one pack of 34 tokens, run as it is
    for item, out in zip(items, packed, strict=True):
        torch.testing.assert_close(out, runner.encode_alone(item), rtol=1e-4, atol=1e-4)
    stats = runner.eager_manager.stats
    assert dict(stats.eager_reasons) == {"no_graph_for_batch": 4}  # the pack, then each item alone
    assert stats.padded_tokens == 0
    assert runner.manager.stats.eager_steps == 0  # the graphs' manager saw none of them


def test_an_item_above_the_largest_budget_is_an_error_naming_it() -> None:
    runner = EncoderRunner(EncoderConfig.small(), _BUDGETS, device="cpu")
    items = random_items(runner.model.config, [4, 129], torch.Generator().manual_seed(0), "cpu")
    with pytest.raises(
        ValueError, match=r"^items\[1\]: an item of 129 patches exceeds the largest budget 128"
    ):
        runner.encode(items)


def _fake_manager(engines: FakeEngines) -> tuple[CUDAGraphManager[torch.Tensor], EncoderRunner]:
    """The example's model in a manager on the fake engines: the graph path on the CPU."""
    runner = EncoderRunner(EncoderConfig.small(), _BUDGETS, device="cpu")
    options: ManagerOptions[torch.Tensor] = ManagerOptions(
        engine_factory=engines, attention=AttentionOptions(metadata_builder=runner.builder)
    )
    manager = CUDAGraphManager(
        runner.model,
        encoder_static_inputs(runner.model.config),
        _BUDGETS.config(),
        device="cpu",
        options=options,
    )
    return manager, runner


def _encode_with(
    manager: CUDAGraphManager[torch.Tensor], runner: EncoderRunner, lengths: list[int], seed: int
) -> None:
    items = random_items(runner.model.config, lengths, torch.Generator().manual_seed(seed), "cpu")
    for pack in runner.pack(items):
        chosen = [items[i] for i in pack.items]
        lens = torch.tensor([c.shape[0] for c in chosen], dtype=torch.int32)
        with torch.no_grad():
            out = manager.run(patches=torch.cat(chosen), item_lens=lens).clone()
        for item, piece in zip(chosen, torch.split(out, lens.tolist()), strict=True):
            torch.testing.assert_close(piece, runner.encode_alone(item), rtol=1e-4, atol=1e-4)


def test_every_budget_replays_and_equals_each_item_alone_on_the_fake_engines() -> None:
    manager, runner = _fake_manager(FakeEngines())
    report = manager.capture()
    assert sorted(g.descriptor.num_tokens for g in report.graphs) == [16, 32, 64, 128]
    for budget in _BUDGETS.budgets:  # one pack that fills each budget exactly, and one just above the last
        _encode_with(manager, runner, [budget], budget)
        _encode_with(manager, runner, [max(1, budget // 2 + 1)], budget + 1)
    for seed, lengths in enumerate(_mixes(1, 8, 128)):
        _encode_with(manager, runner, lengths, seed)
    assert manager.stats.eager_steps == 0
    assert manager.stats.replays_of(_FULL) > 0


def test_background_capture_release_and_wake_serve_every_item_as_alone() -> None:
    manager, runner = _fake_manager(FakeEngines())
    handle = manager.start_capture()
    _encode_with(manager, runner, [3, 40, 9], 0)  # served while the capture runs (eager or replayed)
    handle.wait(60)
    assert handle.done
    assert not handle.errors
    assert manager.num_captured == len(_BUDGETS.budgets)
    _encode_with(manager, runner, [100, 20], 1)
    manager.release()
    _encode_with(manager, runner, [5, 6, 7], 2)  # released: eager, still right
    manager.capture()  # the wake
    replays = manager.stats.replays_of(_FULL)
    _encode_with(manager, runner, [60, 60], 3)
    assert manager.stats.replays_of(_FULL) == replays + 1


def test_the_model_reads_its_offsets_through_the_seam_only() -> None:
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    model = ViTEncoder(EncoderConfig.small(), builder, device="cpu")
    with pytest.raises(RuntimeError, match="attention_metadata"):
        model(patches=torch.zeros(4, 48), item_lens=_lens(4))


def test_a_forward_that_forgets_to_write_the_offsets_is_refused() -> None:
    """Reading ``cu_seqlens`` before ``write_offsets`` since the step's build raises (stale offsets)."""
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    shape = BatchShape(64, 4, None, _FULL)
    meta = builder.build_for_capture(shape)
    with pytest.raises(RuntimeError, match=r"write_offsets\(lengths\)"):
        _ = meta.cu_seqlens
    meta.write_offsets(_lens(5, 20, 12, 0))
    assert meta.cu_seqlens.tolist() == [0, 5, 25, 37, 37, 64]
    again = builder.build(StepBatch(7, 2, {"item_lens": _lens(3, 4)}), shape)  # the next step: written again
    with pytest.raises(RuntimeError, match=r"write_offsets\(lengths\)"):
        _ = again.cu_seqlens
    done: list[bool] = []
    thread = threading.Thread(target=lambda: done.append(builder.build_for_capture(shape) is meta))
    again.write_offsets(_lens(3, 4, 0, 0))
    thread.start()  # another thread's build (a background capture's) leaves this thread's forward alone
    thread.join()
    assert done == [True]
    assert again.cu_seqlens.tolist() == [0, 3, 7, 7, 7, 64]
