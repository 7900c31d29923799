"""Graph memory before capture: ``estimate_memory()`` and vLLM's profiling estimate against the truth (GPU).

Each case is a fresh process of ``tests.benchmarks.memory_estimate``
(warmed up by one estimate, capture and release before anything is timed):
the reference decoder and the 8B-like preset, FULL, PIECEWISE and
FULL_AND_PIECEWISE, over ``CaptureSizes.default(512)`` (51 sizes) and
``default(2048)`` (about 150), and one compiled model. Recorded per case:
the measured drop of free memory over ``capture()``, the report's error
against it, each estimate's signed error (MiB and %) and its time over the
capture's.
"""

from __future__ import annotations

from typing import Final

import pytest

from tests.benchmarks.support import BenchmarkFixture
from tests.capture.test_lean_import_capture import fresh_json

pytestmark = pytest.mark.gpu

CASES: Final = (
    ("reference", "FULL", 512, False),
    ("reference", "PIECEWISE", 512, False),
    ("reference", "FULL_AND_PIECEWISE", 512, False),
    ("reference", "FULL", 2048, False),
    ("reference", "PIECEWISE", 2048, False),
    ("reference", "FULL_AND_PIECEWISE", 2048, False),
    ("reference", "FULL_AND_PIECEWISE", 512, True),
    ("8b_like", "FULL", 512, False),
    ("8b_like", "PIECEWISE", 512, False),
    ("8b_like", "FULL_AND_PIECEWISE", 512, False),
    ("8b_like", "FULL_AND_PIECEWISE", 2048, False),
)


def _case_id(case: tuple[str, str, int, bool]) -> str:
    model, mode, size, compiled = case
    return f"{model}-{mode}-{size}" + ("-compiled" if compiled else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bench_memory_estimate(benchmark: BenchmarkFixture, case: tuple[str, str, int, bool]) -> None:
    model, mode, size, compiled = case
    results: list[dict[str, object]] = []

    def run() -> None:
        flags = ["--compiled"] if compiled else []
        args = ["-m", "tests.benchmarks.memory_estimate", model, mode, str(size), *flags]
        results.append(fresh_json(*args, timeout=500))

    benchmark.group = "graph memory estimates against the capture"
    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(results[0])
