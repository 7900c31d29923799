"""Keys recorded without a warm-up of their own (``ManagerOptions(warm_ups="per_class")``) replay as eager.

A class's first key and each mode's smallest warm up; the other sizes are
recorded cold (their first use paid inside the recording: library
heuristics, cuDNN plans, views). On a GPU, every such key replays fresh
inputs of exactly its size and equals the model run eagerly: the paged
decoder through ``varlen_attn`` (the issue's default model) and the gather
backend, and the row-cache reference decoder (cuDNN attention, a plan per
shape). The rule's choices are tested on the CPU (``test_warm_up_rule``,
``test_manager``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import pytest
import torch

from cudagraph_dispatch import BatchDescriptor, CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CaptureReport, CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions
from examples import DecoderConfig, ReferenceDecoder
from examples.inputs import make_paged_inputs, make_step_inputs
from examples.paged import PagedDecoder, PagedLayout, paged_static_inputs
from examples.reference import static_inputs
from tests.torch_support import rel_err

M: Final = CUDAGraphMode
PAGED_CONFIG: Final = DecoderConfig(num_layers=2, max_num_seqs=32, max_seq_len=512)
MAX_TOKENS: Final = 96  # 15 sizes per class
MODES: Final = (M.FULL, M.FULL_AND_PIECEWISE)
TOL: Final = 3e-2  # bf16, a padded graph against the eager step

Step = Callable[[BatchDescriptor, torch.Generator], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _cold_keys(report: CaptureReport) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
    """The keys recorded without a warm-up of their own; some, and not all."""
    cold = [(g.mode, g.descriptor) for g in report.graphs if not g.loop and g.warmup_seconds == 0]
    assert 0 < len(cold) < report.num_graphs, "per class: some keys record cold, each class's first warms"
    return cold


def _check_cold_keys_replay_as_eager(
    manager: CUDAGraphManager[torch.Tensor], report: CaptureReport, step: Step
) -> None:
    generator = torch.Generator().manual_seed(5)
    worst = 0.0
    with torch.no_grad():
        for mode, key in _cold_keys(report):
            inputs, eager = step(key, generator)
            before = manager.stats.replays.get((mode, key.num_tokens), 0)
            replayed = manager.run_batch(inputs, uniform_decode=key.uniform).clone()
            assert manager.stats.replays.get((mode, key.num_tokens), 0) == before + 1, f"{key} not replayed"
            worst = max(worst, rel_err(replayed, eager))
    assert worst < TOL, f"worst relative error {worst} over the keys recorded cold"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["varlen", "gather"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_paged_keys_recorded_without_a_warm_up_replay_as_eager(backend: str, mode: CUDAGraphMode) -> None:
    config = PAGED_CONFIG
    layout = PagedLayout.for_config(config, page_size=64)
    torch.manual_seed(3)
    model = PagedDecoder(config, layout=layout, backend=backend, device="cuda")
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        DispatchConfig(mode, CaptureSizes.default(MAX_TOKENS), max_num_seqs=config.max_num_seqs),
        strict=True,
        options=ManagerOptions(
            attention=AttentionOptions(metadata_builder=model.backend), warm_ups="per_class"
        ),
    )
    with torch.no_grad():
        report = manager.capture(progress=False)

    def step(
        key: BatchDescriptor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = make_paged_inputs(
            config, layout, key.num_tokens, uniform_decode=key.uniform, generator=generator, device="cuda"
        )
        return inputs, model.step(inputs, uniform_decode=key.uniform)

    _check_cold_keys_replay_as_eager(manager, report, step)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_reference_keys_recorded_without_a_warm_up_replay_as_eager(mode: CUDAGraphMode) -> None:
    """The row-cache decoder: cuDNN's attention makes a plan per shape, here inside the recording."""
    config = DecoderConfig(num_layers=2, max_num_seqs=32)
    torch.manual_seed(4)
    model = ReferenceDecoder(config, device="cuda")
    manager = CUDAGraphManager(
        model.forward,
        static_inputs(config),
        DispatchConfig(mode, CaptureSizes.default(MAX_TOKENS), max_num_seqs=config.max_num_seqs),
        strict=True,
        options=ManagerOptions(warm_ups="per_class"),
    )
    with torch.no_grad():
        report = manager.capture(progress=False)

    def step(
        key: BatchDescriptor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = make_step_inputs(
            config, key.num_tokens, uniform_decode=key.uniform, generator=generator, device="cuda"
        )
        return inputs, model(inputs["input_ids"], inputs["positions"], inputs["cache_rows"])

    _check_cold_keys_replay_as_eager(manager, report, step)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_flex_compiles_per_class_and_never_inside_a_recording(
    mode: CUDAGraphMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled FlexAttention under the default ``"auto"``: one warm-up per compile class it declares.

    dynamo compiles during the classes' warm-ups only (none inside a
    recording), fewer keys warm up than are captured, and every key
    recorded cold replays as eager. The sizes reach past 128 queries, where
    inductor's code for a packed step changes.
    """
    from cudagraph_manager._compiled import dynamo_compiles
    from cudagraph_manager._graphs import _recording

    compiled_in_recordings: list[int] = []
    real = _recording.record

    def counted(graph: object, *args: object) -> object:
        before = dynamo_compiles() or 0
        try:
            return real(graph, *args)  # type: ignore[arg-type]  # the planned graph and the rest, passed through
        finally:
            compiled_in_recordings.append((dynamo_compiles() or 0) - before)

    monkeypatch.setattr(_recording, "record", counted)
    config = PAGED_CONFIG
    layout = PagedLayout.for_config(config, page_size=64)
    torch.manual_seed(6)
    model = PagedDecoder(config, layout=layout, backend="flex", device="cuda")
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        DispatchConfig(mode, CaptureSizes.default(160), max_num_seqs=config.max_num_seqs),
        strict=True,
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )
    with torch.no_grad():
        report = manager.capture(progress=False)
    assert sum(compiled_in_recordings) == 0, compiled_in_recordings
    assert len(compiled_in_recordings) == report.num_graphs  # each key recorded once: none again

    def step(
        key: BatchDescriptor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = make_paged_inputs(
            config, layout, key.num_tokens, uniform_decode=key.uniform, generator=generator, device="cuda"
        )
        return inputs, model.step(inputs, uniform_decode=key.uniform)

    _check_cold_keys_replay_as_eager(manager, report, step)
