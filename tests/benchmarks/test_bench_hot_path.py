"""Host cost of the pieces on the manager's per-step path, each against its alternative.

- Replay: ``torch.cuda.CUDAGraph.replay`` (public: liveness checks, hooks)
  against ``torch._C._CUDAGraph.replay`` (the binding underneath). The
  public path is kept unless it costs more than 0.5 us per replay.
- Static-buffer views: slicing ``tensor[:n]`` and ``tensor[n:g]`` each step
  against ``StaticBuffer``'s per-row-count cache of them.
- Output cut: the pytree map that cuts the outputs against the manager's
  memo of the last cut (same graph output, same row counts).

A cache stays only where it saves more than 1 us per step. Host time only:
each round times ``_CALLS`` calls without a sync (the device work is tiny),
then synchronizes outside the timed region. Rounds alternate the two
candidates; ``extra_info`` holds the medians and the saving per call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Final

import pytest
import torch

from cudagraph_manager._memory._outputs import OutputLayout
from tests.benchmarks.support import BenchmarkFixture

pytestmark = pytest.mark.gpu

_CALLS: Final = 200
_ROUNDS: Final = 101


def _interleaved_host_us(
    first: Callable[[], object], second: Callable[[], object]
) -> tuple[float, float, float]:
    """Median host microseconds per call of each, and the median per-round difference (first - second)."""
    samples: tuple[list[float], list[float]] = ([], [])
    for index in range(_ROUNDS + 3):
        for slot, call in enumerate((first, second)):
            torch.cuda.synchronize()
            start = time.perf_counter_ns()
            for _ in range(_CALLS):
                call()
            elapsed = time.perf_counter_ns() - start
            if index >= 3:
                samples[slot].append(elapsed / _CALLS / 1e3)
    torch.cuda.synchronize()
    diffs = [a - b for a, b in zip(*samples, strict=True)]
    return statistics.median(samples[0]), statistics.median(samples[1]), statistics.median(diffs)


def _record(
    benchmark: BenchmarkFixture,
    group: str,
    names: tuple[str, str],
    first: Callable[[], object],
    second: Callable[[], object],
) -> float:
    results: list[tuple[float, float, float]] = []
    benchmark.group = group
    benchmark.pedantic(lambda: results.append(_interleaved_host_us(first, second)), rounds=1, iterations=1)
    ((one, two, saving),) = results
    benchmark.extra_info.update(
        {f"{names[0]}_us": one, f"{names[1]}_us": two, f"{names[0]}_minus_{names[1]}_us": saving}
    )
    return saving


def test_bench_replay_public_against_private(benchmark: BenchmarkFixture) -> None:
    x = torch.randn(64, device="cuda")
    x.mul_(2.0)  # warm the kernel up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(2.0)
    private = torch._C._CUDAGraph.replay
    _record(
        benchmark,
        "hot path: one-kernel graph replay, host us per call",
        ("public", "private"),
        graph.replay,
        lambda: private(graph),
    )


def test_bench_view_cache_against_slicing(benchmark: BenchmarkFixture) -> None:
    buffer = torch.zeros(512, 1024, device="cuda")
    cache = {(5, 8): (buffer[:5], buffer[5:8])}
    _record(
        benchmark,
        "hot path: the two views of one input per step, host us",
        ("slicing", "cached"),
        lambda: (buffer[:5], buffer[5:8]),
        lambda: cache.get((5, 8)),
    )


def test_bench_output_memo_against_cutting(benchmark: BenchmarkFixture) -> None:
    raw = torch.randn(16, 1024, device="cuda")
    layout = OutputLayout.of(raw, "tokens")
    memo = (raw, 13, 0, layout.cut(raw, 13, 0))

    def hit() -> object:
        last = memo
        if last[0] is raw and last[1] == 13 and last[2] == 0:
            return last[3]
        return None

    _record(
        benchmark,
        "hot path: cutting one [16, 1024] output to 13 rows, host us",
        ("pytree_cut", "memo"),
        lambda: layout.cut(raw, 13, 0),
        hit,
    )


def test_bench_weights_check_against_nothing(benchmark: BenchmarkFixture) -> None:
    """``WeightWatch.needs_check()``, the replay's weights check (target: <= 0.5 us), reference decoder."""
    from cudagraph_manager._memory._weights import WeightWatch
    from examples.config import DecoderConfig
    from examples.reference import ReferenceDecoder

    watch = WeightWatch(ReferenceDecoder(DecoderConfig(), device="cuda"))
    watch.take()
    assert not watch.needs_check()
    _record(
        benchmark,
        "hot path: the replay's weights check (8-layer decoder), host us",
        ("weights_check", "nothing"),
        watch.needs_check,
        lambda: None,
    )
