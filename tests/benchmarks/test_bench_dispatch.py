"""Per-step cost of CUDAGraphDispatcher.dispatch, against an empty call in the same run.

The dispatcher is the one from vLLM's defaults: CaptureSizes.default(512) (51
sizes), FULL_AND_PIECEWISE, max_num_seqs=256. Each round loops over a fixed,
pre-generated list of mixed steps (uniform decode and mixed batches, some above
the largest size), so the per-call cost is the round time over the list length;
the baseline loop calls a no-op with the same arguments, which is the loop's
own overhead. ``extra_info['per_call_us']`` is the median round over the calls.

Run with ``pytest tests/benchmarks/test_bench_dispatch.py --benchmark-only``.
No timed assertions: machines are noisy.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Final, Protocol

import pytest

from cudagraph_dispatch import CaptureSizes, CUDAGraphDispatcher, CUDAGraphMode, Dispatch, DispatchConfig

CALLS: Final = 2_000
ROUNDS: Final = 200


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
