"""Encoder graphs keyed by token budget against eager, in one run (issue 42); prints a JSON summary.

Usage: ``python -m tests.benchmarks.encoder_throughput [--mixes N] [--rounds N] [--ladder L] [--small]``.

The example ViT (``examples.encoder``: 12 blocks, 768 wide, bf16, varlen
attention) over random mixes of 1-8 items of 64-1,024 patches (seeded),
with ``TokenBudgets.default(8192, max_items=8)``. Both sides pack the same
way (``TokenBudgets.pack``) and cut the output per item; the graph side pads
each pack to its budget and replays its FULL graph (``EncoderRunner.encode``),
the eager side runs each pack unpadded (``encode_eager``). Rounds alternate
the two over every mix, each round timed with a device sync around it;
the medians give items per second and the ratio. Also: the packing's
padding waste (padding over budget, per pack: mean and worst; and over all
tokens), each item against the item alone (mismatches: relative L2 error
above 2e-2), and the host cost of pack + dispatch + build per batch.
``--small``: a 2-block encoder, on the CPU too (no graphs there: a smoke run).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Final

import torch

from cudagraph_dispatch import Dispatch
from cudagraph_dispatch.budgets import TokenBudgets
from cudagraph_manager.attention import BatchShape, StepBatch
from examples.encoder import EncoderConfig, EncoderRunner, random_items

_RTOL: Final = 2e-2
_LADDERS: Final = {
    "pow2": TokenBudgets.default(8192, max_items=8),
    "fine": TokenBudgets([64, 128, 256, 512, *range(1024, 8193, 512)], max_items=8),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _waste(budgets: TokenBudgets, mixes: Sequence[Sequence[int]]) -> dict[str, float]:
    packs = [pack for lengths in mixes for pack in budgets.pack(lengths)]
    per_pack = [pack.padding / pack.budget for pack in packs]
    return {
        "packs": len(packs),
        "split_batches": sum(len(budgets.pack(lengths)) > 1 for lengths in mixes),
        "mean": statistics.fmean(per_pack),
        "worst": max(per_pack),
        "over_all_tokens": sum(p.padding for p in packs) / sum(p.budget for p in packs),
    }


def _host_us(runner: EncoderRunner, mixes: Sequence[Sequence[int]]) -> float:
    """Median microseconds per batch of pack + route + build (the lengths already on the device)."""
    dispatcher = runner.manager.dispatcher
    lens = [torch.tensor(m, dtype=torch.int32, device=runner.device) for m in mixes]
    rounds = []
    for _ in range(20):
        start = time.perf_counter()
        for lengths, on_device in zip(mixes, lens, strict=True):
            for pack in runner.budgets.pack(lengths):
                route = dispatcher.route(pack.tokens)
                if isinstance(route, Dispatch):
                    key = route.descriptor
                    shape = BatchShape.of_key(route.mode, key, key.num_reqs or 0)
                    batch = StepBatch(pack.tokens, len(pack.items), {"item_lens": on_device})
                    runner.builder.build(batch, shape)
        rounds.append((time.perf_counter() - start) / len(mixes) * 1e6)
    _sync(runner.device)
    return statistics.median(rounds)


def _mismatches(runner: EncoderRunner, batches: Sequence[list[torch.Tensor]]) -> tuple[int, float]:
    """Items whose graph output is off the item alone, and the worst relative error."""
    bad, worst = 0, 0.0
    for items in batches:
        for item, out in zip(items, runner.encode(items), strict=True):
            ref = runner.encode_alone(item).float()
            error = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))
            worst = max(worst, error)
            bad += not error <= _RTOL
    return bad, worst


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mixes", type=int, default=64, help="random mixes of 1-8 items (default 64)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per side (default 7)")
    parser.add_argument("--small", action="store_true", help="a 2-block encoder (any device)")
    parser.add_argument(
        "--ladder",
        choices=("pow2", "fine"),
        default="pow2",
        help="pow2: 64, 128, ..., 8192 (vLLM's, default); fine: pow2 to 1024, then every 512 (less padding)",
    )
    args = parser.parse_args(argv)
    config = EncoderConfig.small() if args.small else EncoderConfig()
    budgets = _LADDERS[args.ladder]
    runner = EncoderRunner(config, budgets)
    rng = random.Random(0)
    mixes = [[rng.randint(64, 1024) for _ in range(rng.randint(1, 8))] for _ in range(args.mixes)]
    generator = torch.Generator().manual_seed(0)
    batches = [random_items(config, m, generator, runner.device) for m in mixes]
    report = runner.manager.capture()
    with torch.no_grad():
        for batch in batches[:4]:  # warm both sides (allocator, kernels)
            runner.encode(batch), runner.encode_eager(batch)
        graph, eager = [], []
        for _ in range(args.rounds):
            graph.append(_timed(lambda: [runner.encode(b) for b in batches], runner.device))
            eager.append(_timed(lambda: [runner.encode_eager(b) for b in batches], runner.device))
        mismatches, worst = _mismatches(runner, batches)
    items = sum(len(m) for m in mixes)
    graph_s, eager_s = statistics.median(graph), statistics.median(eager)
    summary: dict[str, object] = {
        "device": torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": {
            "layers": config.layers,
            "hidden": config.hidden,
            "dtype": str(config.dtype),
            "kernel": runner.model.kernel,
        },
        "budgets": list(budgets.budgets),
        "max_items": budgets.max_items,
        "graphs_captured": report.num_graphs,
        "mixes": len(mixes),
        "items": items,
        "patches": sum(sum(m) for m in mixes),
        "graph_items_per_s": items / graph_s,
        "eager_items_per_s": items / eager_s,
        "graph_over_eager": eager_s / graph_s,
        "graph_ms_per_mix": graph_s / len(mixes) * 1e3,
        "eager_ms_per_mix": eager_s / len(mixes) * 1e3,
        "padding_waste": _waste(budgets, mixes),
        "host_us_per_batch": _host_us(runner, mixes),
        "mismatches": mismatches,
        "worst_relative_error": worst,
        "stats": str(runner.manager.stats),
    }
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
