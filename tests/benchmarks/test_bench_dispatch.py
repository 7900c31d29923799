"""CUDAGraphDispatcher: the per-step cost of dispatch, and the cost of building one.

Per step: the dispatcher is the one from vLLM's defaults, CaptureSizes.default(512)
(51 sizes), FULL_AND_PIECEWISE, max_num_seqs=256. Each round loops over a fixed,
pre-generated list of mixed steps (uniform decode and mixed batches, some above
the largest size), so the per-call cost is the round time over the list length;
the baseline loop calls a no-op with the same arguments, which is the loop's
own overhead. ``extra_info['per_call_us']`` is the median round over the calls.

Build: a dispatcher's tables hold one decision per capture size, so building
one costs per size, not per token count. Two configs at the far end: sizes
[1, 2**20], and CaptureSizes.default(32768) (2067 sizes) with four LoRA counts.
``extra_info['build_ms']`` is the median build, ``extra_info['peak_bytes']``
the peak memory of one build, traced separately (tracing slows the build).

Run with ``pytest tests/benchmarks/test_bench_dispatch.py --benchmark-only``.
No timed assertions: machines are noisy.
"""

from __future__ import annotations

import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Final, Protocol

import pytest

from cudagraph_dispatch import CaptureSizes, CUDAGraphDispatcher, CUDAGraphMode, Dispatch, DispatchConfig

CALLS: Final = 2_000
ROUNDS: Final = 200
BUILD_ROUNDS: Final = 20
#: The configs whose build is measured: the largest sizes, and the most sizes with LoRA.
BUILD_CONFIGS: Final = {
    "sizes_1_and_2**20": DispatchConfig(CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes([1, 2**20]), 256),
    "default_32768_lora_1_2_4_8": DispatchConfig(
        CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(32768), 1024, lora_counts=(1, 2, 4, 8)
    ),
}


class _Benchmark(Protocol):
    """The part of pytest-benchmark's fixture used here (its own methods are untyped)."""

    extra_info: dict[str, object]
    group: str | None

    def pedantic(
        self,
        target: Callable[[], object],
        *,
        rounds: int,
        iterations: int,
        warmup_rounds: int,
    ) -> object: ...


def _steps(seed: int = 0) -> list[tuple[int, bool]]:
    """A fixed mix of engine steps: half uniform decode (1-256 tokens), half mixed (1-600 tokens)."""
    rng = random.Random(seed)
    steps = []
    for _ in range(CALLS):
        if rng.random() < 0.5:
            steps.append((rng.randint(1, 256), True))
        else:
            steps.append((rng.randint(1, 600), False))  # ~15% above 512: the eager path
    return steps


def _dispatcher() -> CUDAGraphDispatcher:
    config = DispatchConfig(CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(512), max_num_seqs=256)
    assert len(config.capture_sizes.sizes) == 51
    return CUDAGraphDispatcher(config)


def _no_op(num_tokens: int, *, uniform_decode: bool = False) -> None:
    """Same call shape as dispatch, no work: the cost of the loop and the call itself."""


@pytest.mark.parametrize("target", ["dispatch", "baseline_noop"])
def test_bench_dispatch(benchmark: _Benchmark, target: str) -> None:
    """Median microseconds per dispatch over a fixed list of mixed steps (and the empty-call baseline)."""
    steps = _steps()
    call: Callable[..., Dispatch | None] = _dispatcher().dispatch if target == "dispatch" else _no_op
    samples_ns: list[int] = []

    def one_round() -> None:
        start = time.perf_counter_ns()
        for num_tokens, uniform in steps:
            call(num_tokens, uniform_decode=uniform)
        samples_ns.append(time.perf_counter_ns() - start)

    benchmark.group = "dispatch"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=10)
    timed = samples_ns[-ROUNDS:]  # the warm-up rounds come first
    benchmark.extra_info["calls_per_round"] = len(steps)
    benchmark.extra_info["per_call_us"] = statistics.median(timed) / len(steps) / 1e3
    benchmark.extra_info["min_per_call_us"] = min(timed) / len(steps) / 1e3


def _peak_build_bytes(config: DispatchConfig) -> int:
    """Peak memory allocated while building one dispatcher for ``config`` (tracemalloc)."""
    tracemalloc.start()
    try:
        CUDAGraphDispatcher(config)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", list(BUILD_CONFIGS))
def test_bench_build(benchmark: _Benchmark, name: str) -> None:
    """Median milliseconds to build a dispatcher, and its peak memory, for configs with huge or many sizes."""
    config = BUILD_CONFIGS[name]
    samples_ns: list[int] = []

    def one_build() -> CUDAGraphDispatcher:
        start = time.perf_counter_ns()
        dispatcher = CUDAGraphDispatcher(config)
        samples_ns.append(time.perf_counter_ns() - start)
        return dispatcher  # freed after the clock stopped: freeing is not building

    benchmark.group = "dispatcher build"
    benchmark.pedantic(one_build, rounds=BUILD_ROUNDS, iterations=1, warmup_rounds=2)
    timed = samples_ns[-BUILD_ROUNDS:]
    benchmark.extra_info["capture_sizes"] = len(config.capture_sizes)
    benchmark.extra_info["lora_cases"] = 1 + len(config.lora_counts)
    benchmark.extra_info["build_ms"] = statistics.median(timed) / 1e6
    benchmark.extra_info["min_build_ms"] = min(timed) / 1e6
    benchmark.extra_info["peak_bytes"] = _peak_build_bytes(config)
