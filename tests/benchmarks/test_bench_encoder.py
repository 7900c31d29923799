"""Host cost of an encoder's batch: packing + dispatch + building the metadata, for 8 items.

What ``EncoderRunner.encode`` does on the host before a replay, per batch of
8 items of 64-1,024 tokens that fit one pack (issue 42's target: at most
20 us): ``TokenBudgets.pack``, the dispatcher's ``route`` of the pack's
tokens, and ``PackedMetadataBuilder.build`` (a look-up of the shape's view:
no device op, the forward writes the offsets inside the graph). A fixed list
of batches is cycled; the lengths tensors are made beforehand (an engine
has them on the device already). On CUDA where available, else the CPU.
``extra_info['per_batch_us']``: the median round over its batches;
``extra_info['breakdown_us']``: each part's median per batch
(``encoder_throughput.host_breakdown``: pack, route, build, their total,
and the lengths tensor's making apart).

Run with ``pytest tests/benchmarks/test_bench_encoder.py --benchmark-only``.
No timed assertions: machines are noisy. Throughput against eager:
``python -m tests.benchmarks.encoder_throughput`` (GPU).
"""

from __future__ import annotations

import random
from typing import Final

import torch

from cudagraph_dispatch import CUDAGraphDispatcher, Dispatch
from cudagraph_dispatch.budgets import TokenBudgets
from cudagraph_manager.attention import BatchShape, PackedMetadataBuilder, StepBatch
from tests.benchmarks.encoder_throughput import host_breakdown
from tests.benchmarks.support import BenchmarkFixture

_BATCHES: Final = 200
_ITEMS: Final = 8


def test_host_cost_of_pack_dispatch_and_build(benchmark: BenchmarkFixture) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    budgets = TokenBudgets.default(8192, max_items=_ITEMS)
    dispatcher = CUDAGraphDispatcher(budgets.config())
    builder = PackedMetadataBuilder(budgets, device=device)
    rng = random.Random(0)
    batches = []
    for _ in range(_BATCHES):
        lengths = [rng.randint(64, 1024) for _ in range(_ITEMS)]
        batches.append((lengths, torch.tensor(lengths, dtype=torch.int32, device=device)))
    shapes = {  # the manager keeps one per graph
        d.descriptor: BatchShape.of_key(d.mode, d.descriptor, d.descriptor.num_reqs or 0)
        for d in (dispatcher.route(b) for b in budgets.budgets)
        if isinstance(d, Dispatch)
    }

    def batch_round() -> None:
        for lengths, lens in batches:
            for pack in budgets.pack(lengths):
                route = dispatcher.route(pack.tokens)
                assert isinstance(route, Dispatch)
                inputs = {"item_lens": lens}  # the 8 items fit one pack of 8192
                builder.build(StepBatch(pack.tokens, len(pack.items), inputs), shapes[route.descriptor])
        if device == "cuda":
            torch.cuda.synchronize()

    benchmark.group = "encoder host cost"
    benchmark.pedantic(batch_round, rounds=50, warmup_rounds=3)
    stats = benchmark.stats
    if stats is not None:
        benchmark.extra_info["per_batch_us"] = stats.stats.median / _BATCHES * 1e6
    benchmark.extra_info["device"] = device
    mixes = [lengths for lengths, _ in batches]
    benchmark.extra_info["breakdown_us"] = host_breakdown(
        budgets, dispatcher, builder, mixes, torch.device(device)
    )
