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
above 2e-2), and the host cost per batch of pack, route and build, each
and together, for batches of 8 items (``host_breakdown``; the lengths
tensor's making and the build's former kernel launches apart).
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

from cudagraph_dispatch import CUDAGraphDispatcher, Dispatch
from cudagraph_dispatch._rule import Route
from cudagraph_dispatch.budgets import Pack, TokenBudgets
from cudagraph_manager.attention import BatchShape, PackedMetadata, PackedMetadataBuilder, StepBatch
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


def host_breakdown(
    budgets: TokenBudgets,
    dispatcher: CUDAGraphDispatcher,
    builder: PackedMetadataBuilder,
    mixes: Sequence[Sequence[int]],
    device: torch.device,
    rounds: int = 30,
) -> dict[str, float]:
    """Median host microseconds per batch of each part before a replay, and of the three together.

    ``pack`` (``TokenBudgets.pack``), ``route`` (the dispatcher's route of
    each pack's tokens), ``build`` (the step's ``StepBatch`` and the
    builder's ``build`` for the key's shape, as the manager calls it) and
    ``total``: pack + route + build in one loop (issue 42's target: at most
    20 us for 8 items). ``lengths_tensor``, outside the total: the lengths
    as a device tensor from a Python list (``EncoderRunner``'s, a
    host-to-device copy; an engine may have them on the device already).
    ``cumsum_fill_launches``, outside the total too: the two device ops the
    builder's ``build`` launched per batch before the offsets moved into the
    forward (the baseline of the build in the same run).
    Each part runs over every mix per round, a device sync after each round
    (not timed).
    """
    shapes = {  # the manager keeps one per graph
        d.descriptor: BatchShape.of_key(d.mode, d.descriptor, d.descriptor.num_reqs or 0)
        for d in (dispatcher.route(b) for b in budgets.budgets)
        if isinstance(d, Dispatch)
    }
    on_device = [torch.tensor(m, dtype=torch.int32, device=device) for m in mixes]
    packs = [budgets.pack(m) for m in mixes]
    routes = [[dispatcher.route(p.tokens) for p in ps] for ps in packs]
    scratch = torch.zeros(budgets.max_items + 2, dtype=torch.int32, device=device)

    def launches(
        lengths: torch.Tensor,
    ) -> torch.Tensor:  # the build before: the ends by a cumsum, then a fill
        torch.cumsum(lengths, 0, dtype=torch.int32, out=scratch[1 : lengths.shape[0] + 1])
        return scratch[lengths.shape[0] + 1 :].fill_(budgets.max)

    def build(i: int, pack: Pack, route: Route) -> PackedMetadata | None:
        if not isinstance(route, Dispatch):
            return None
        batch = StepBatch(pack.tokens, len(pack.items), {"item_lens": on_device[i]})
        return builder.build(batch, shapes[route.descriptor])

    def total() -> None:
        for i, lengths in enumerate(mixes):
            for pack in budgets.pack(lengths):
                build(i, pack, dispatcher.route(pack.tokens))

    parts: dict[str, Callable[[], object]] = {
        "pack": lambda: [budgets.pack(m) for m in mixes],
        "route": lambda: [dispatcher.route(p.tokens) for ps in packs for p in ps],
        "build": lambda: [
            build(i, p, r) for i, ps in enumerate(packs) for p, r in zip(ps, routes[i], strict=True)
        ],
        "total": total,
        "lengths_tensor": lambda: [torch.tensor(m, dtype=torch.int32, device=device) for m in mixes],
        "cumsum_fill_launches": lambda: [launches(t) for t in on_device],
    }
    return {name: _median_us(fn, device, rounds) / len(mixes) for name, fn in parts.items()}


def _median_us(fn: Callable[[], object], device: torch.device, rounds: int) -> float:
    """The median microseconds of ``fn`` over ``rounds`` (two untimed first), a sync after each."""
    times = []
    for r in range(rounds + 2):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        _sync(device)
        if r >= 2:
            times.append(elapsed * 1e6)
    return statistics.median(times)


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
    eights = [[rng.randint(64, 1024) for _ in range(8)] for _ in range(200)]  # the host target's batches
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
        "host_us_per_batch_of_8_items": host_breakdown(
            budgets, runner.manager.dispatcher, runner.builder, eights, runner.device
        ),
        "mismatches": mismatches,
        "worst_relative_error": worst,
        "stats": str(runner.manager.stats),
    }
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
