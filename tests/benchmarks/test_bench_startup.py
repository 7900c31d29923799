"""Start-up against its floor (GPU): each case a fresh process of ``tests.benchmarks.startup``.

The reference decoder and the 8B-like preset, FULL and FULL_AND_PIECEWISE,
over ``CaptureSizes.default(512)``: the cold first capture, then warm rounds
alternating ``capture()`` with the hand-written record + instantiate loop
(the floor). Recorded per case: the floor, ours over it warm (with and
without per-key warm-ups), the cold capture over the warm floor, and each
capture's split into warm-ups, recordings, instantiations and the rest.
"""

from __future__ import annotations

from typing import Final

import pytest

from tests.benchmarks.support import BenchmarkFixture
from tests.capture.test_lean_import_capture import fresh_json

pytestmark = pytest.mark.gpu

CASES: Final = (
    ("reference", "FULL"),
    ("reference", "FULL_AND_PIECEWISE"),
    ("8b_like", "FULL"),
    ("8b_like", "FULL_AND_PIECEWISE"),
)


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_bench_startup(benchmark: BenchmarkFixture, case: tuple[str, str]) -> None:
    model, mode = case
    results: list[dict[str, object]] = []

    def run() -> None:
        args = ["-m", "tests.benchmarks.startup", "--model", model, "--mode", mode, "--cold"]
        results.append(fresh_json(*args, timeout=500))

    benchmark.group = "start-up: capture() against the record + instantiate floor"
    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(results[0])
