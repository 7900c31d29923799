"""Decode loops of the paged reference decoder on the GPU: tokens per second, five ways, same tokens.

For the demo's model (``DecoderConfig()``, FlexAttention on pages of 128)
and the 8B-like preset (``DecoderConfig.llama_8b_like()`` cut to 4 layers
for time, pages of 64), at 1, 8 and 64 requests, ``STEPS`` greedy steps
(prompts short enough that no request finishes, so every way runs them
all):

- ``while``: ``run_loop``, one WHILE launch (``LoopKind.WHILE``);
- ``unrolled``: ``run_loop`` of a manager whose loop is forced ``UNROLLED``
  (8 iterations per launch, a read-back after each);
- ``host_readback``: ``run`` per step, the advance's input update, the
  stop flag read back after each step (``demo_loop.host_loop``);
- ``host_no_readback``: the same steps without the read-back;
- ``floor``: a graph of the one-step forward and the advance, replayed
  back to back with nothing between (the device's work alone).

Recorded (``extra_info``): tokens per second of each, the device loop's
time over the floor's (target at most 1.02) and over the host loop's with
read-back. Only correctness is asserted: every way gives the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Final

import pytest
import torch

from cudagraph_capture import LoopKind, LoopPolicy
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_manager import CUDAGraphManager, DecodeLoop, LoopState, ManagerOptions
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch, metadata_extra
from examples import DecoderConfig
from examples.demo_loop import host_loop
from examples.paged import PAGED_INPUT_NAMES, PagedDecoder, PagedLayout, paged_static_inputs
from examples.paged.loop import NO_TOKEN, PagedAdvance, decode_batch, greedy_advance
from tests.benchmarks.support import (
    BenchmarkFixture,
    Interleaved,
    interleave,
    plain_graph,
    record_interleaved,
)

pytestmark = pytest.mark.gpu

BATCHES: Final = (1, 8, 64)
ROUNDS: Final = 7
#: (preset, steps per loop, page size): the 8B-like preset holds 64 positions per request.
PRESETS: Final = {"default": (64, 128), "llama_8b_like": (32, 64)}
#: Layers of the 8B-like preset kept (the others add time, not insight: every layer is the same).
LLAMA_LAYERS: Final = 4


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    """A model, its advance, and two managers over it (WHILE, and forced UNROLLED), captured."""

    model: PagedDecoder
    advance: PagedAdvance
    steps: int
    looped: CUDAGraphManager[torch.Tensor]
    unrolled: CUDAGraphManager[torch.Tensor]


def _config(preset: str) -> DecoderConfig:
    if preset == "default":
        return DecoderConfig()
    return dataclasses.replace(DecoderConfig.llama_8b_like(), num_layers=LLAMA_LAYERS)


@functools.cache
def _setup(preset: str) -> Setup:
    steps, page_size = PRESETS[preset]
    torch.manual_seed(0)
    config = _config(preset)
    model = PagedDecoder(config, layout=PagedLayout.for_config(config, page_size=page_size), device="cuda")
    advance = greedy_advance(model, eos_id=None, max_len=config.max_seq_len)
    managers = [_manager(model, advance, steps, kind) for kind in (None, LoopKind.UNROLLED)]
    with torch.no_grad():
        for manager in managers:
            manager.capture(progress=False)
    return Setup(model, advance, steps, *managers)


def _manager(
    model: PagedDecoder, advance: PagedAdvance, steps: int, kind: LoopKind | None
) -> CUDAGraphManager[torch.Tensor]:
    # Uniform keys, as the floor records: the same layout of the batch on both sides.
    dispatch = DispatchConfig(
        CUDAGraphMode.FULL_DECODE_ONLY, CaptureSizes(list(BATCHES)), max_num_seqs=max(BATCHES)
    )
    return CUDAGraphManager(
        model,
        paged_static_inputs(model.layout),
        dispatch,
        options=ManagerOptions(
            decode_loop=DecodeLoop(advance, max_steps=steps, policy=LoopPolicy(kind, unroll=8)),
            attention=AttentionOptions(metadata_builder=model.backend),
        ),
    )


def _batch(setup: Setup, num_reqs: int) -> dict[str, torch.Tensor]:
    """Prompts of 1 to ``max_len - steps - 1`` tokens: nobody reaches ``max_len`` within the loop."""
    max_len = setup.advance.max_len
    generator = torch.Generator().manual_seed(num_reqs)
    lens = torch.randint(1, max_len - setup.steps, (num_reqs,), generator=generator).tolist()
    return decode_batch(setup.model, lens, max_len=max_len, generator=generator, device="cuda")


def _host_no_readback(setup: Setup, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``host_loop`` without the stop read-back: ``steps`` runs and advances, one sync at the end."""
    inputs = {name: tensor.clone() for name, tensor in batch.items()}
    state = _state(inputs["input_ids"].shape[0], setup.steps)
    for step in range(setup.steps):
        state.step.fill_(step)
        setup.advance.step_inputs(setup.looped.run_batch(inputs, uniform_decode=True), inputs, state)
    torch.cuda.synchronize()
    return state.tokens


def _state(num_reqs: int, steps: int) -> LoopState:
    return LoopState(
        torch.zeros((), dtype=torch.int64, device="cuda"),
        torch.zeros((), dtype=torch.bool, device="cuda"),
        torch.ones(num_reqs, dtype=torch.bool, device="cuda"),
        torch.full((steps, num_reqs), NO_TOKEN, dtype=torch.int64, device="cuda"),
    )


def _floor(
    setup: Setup, batch: Mapping[str, torch.Tensor], steps: int | None = None
) -> Callable[[], torch.Tensor]:
    """The forward and the advance as one plain torch graph of the batch, replayed ``steps`` times.

    ``steps``: ``setup.steps`` unless given (the loop-floor profile takes 1 too).

    Its own static inputs (refilled from ``batch`` per call) and state; the
    metadata built once, advanced by the graph. Returns the call, which
    gives the tokens ``[steps, R]`` of the real rows.
    """
    model, num_reqs = setup.model, batch["input_ids"].shape[0]
    static = {name: tensor.clone() for name, tensor in batch.items()}  # unpadded: the key is the batch
    shape = BatchShape(num_reqs, num_reqs, 1, CUDAGraphMode.FULL)
    metadata = model.backend.build(StepBatch(num_reqs, num_reqs, static), shape)
    state = _state(num_reqs, setup.steps)
    context = metadata_extra(model.backend, metadata)
    key = BatchDescriptor(num_reqs, num_reqs, True)

    def body() -> None:
        with torch.no_grad(), set_forward_context(CUDAGraphMode.FULL, key, **context):
            setup.advance(model(*(static[name] for name in PAGED_INPUT_NAMES)), static, state)
            state.step.add_(1)  # in the graph: nothing runs between two replays

    graph = plain_graph(body)
    replays = setup.steps if steps is None else steps

    def run() -> torch.Tensor:
        for name, tensor in batch.items():
            static[name].copy_(tensor)
        model.backend.build(StepBatch(num_reqs, num_reqs, static), shape)  # the same buffers, refilled
        state.active.fill_(True)
        state.step.zero_()
        for _ in range(replays):
            graph.replay()
        return state.tokens

    return run


@pytest.mark.parametrize("num_reqs", BATCHES)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_bench_decode_loop_tokens_per_second(benchmark: BenchmarkFixture, preset: str, num_reqs: int) -> None:
    setup = _setup(preset)
    batch = _batch(setup, num_reqs)
    floor = _floor(setup, batch)
    with torch.no_grad():
        candidates: dict[str, Callable[[], object]] = {
            "while": lambda: setup.looped.run_loop(max_steps=setup.steps, **batch),
            "unrolled": lambda: setup.unrolled.run_loop(max_steps=setup.steps, **batch),
            "host_readback": lambda: host_loop(setup.looped, setup.advance, batch, setup.steps),
            "host_no_readback": lambda: _host_no_readback(setup, batch),
            "floor": floor,
        }
        _check_same_tokens(setup, batch, floor)
        results: list[Interleaved] = []
        benchmark.group = f"decode loop {preset}"
        benchmark.pedantic(
            lambda: results.append(interleave(candidates, rounds=ROUNDS, calls_per_round=1)),
            rounds=1,
            iterations=1,
        )
    (result,) = results
    tokens = num_reqs * setup.steps
    info = benchmark.extra_info
    for name in candidates:
        info[f"{name}_tokens_per_s"] = tokens / result.median(name)
    ratios = {
        "while_over_floor": ("while", "floor"),  # target <= 1.02
        "while_speedup_over_host_readback": ("host_readback", "while"),
        "unrolled_over_floor": ("unrolled", "floor"),
    }
    record_interleaved(info, result, ratios, medians=False)
    info.update({"steps": setup.steps, "num_reqs": num_reqs, "layers": setup.model.config.num_layers})
    info["while_over_floor_target"] = 1.02


def _check_same_tokens(
    setup: Setup, batch: Mapping[str, torch.Tensor], floor: Callable[[], torch.Tensor]
) -> None:
    """Every way gives the same tokens, all ``steps`` of them (no request finishes)."""
    looped = setup.looped.run_loop(max_steps=setup.steps, **batch)
    assert looped.kind is LoopKind.WHILE
    assert looped.steps == setup.steps
    expected = looped.tokens.clone()
    unrolled = setup.unrolled.run_loop(max_steps=setup.steps, **batch)
    assert unrolled.kind is LoopKind.UNROLLED
    assert torch.equal(unrolled.tokens, expected)
    assert torch.equal(host_loop(setup.looped, setup.advance, batch, setup.steps), expected)
    assert torch.equal(_host_no_readback(setup, batch), expected)
    assert torch.equal(floor(), expected)
