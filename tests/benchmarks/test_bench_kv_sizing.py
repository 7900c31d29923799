"""KV sizing end to end in fresh processes: no out-of-memory, the leftover explained (GPU).

Each run is ``python -m examples.kv_sizing MODEL --json``
(profile an eager step, estimate the graphs, fill the device with a KV cache
up to the estimate and a 512 MiB margin, capture, serve). Recorded: runs
that failed (an out-of-memory error fails one), the estimate's signed error
against the capture's measured cost (worst and median), the leftover over
the margin, and the estimate's time over the capture's.
"""

from __future__ import annotations

import statistics
from typing import Final

import pytest

from tests.benchmarks.support import BenchmarkFixture
from tests.manager.test_kv_sizing import check_kv_sizing, run_kv_sizing

pytestmark = pytest.mark.gpu

#: Fresh processes per model: ten of the reference decoder; three of the 8B-like one (device time).
RUNS: Final = {"reference": 10, "8b_like": 3}
MIB: Final = 2**20


@pytest.mark.parametrize("model", ["reference", "8b_like"])
def test_bench_kv_sizing(benchmark: BenchmarkFixture, model: str) -> None:
    runs: list[dict[str, float]] = []
    benchmark.group = f"KV sizing in {RUNS[model]} fresh processes: {model}"
    benchmark.pedantic(
        lambda: runs.extend(run_kv_sizing(model) for _ in range(RUNS[model])), rounds=1, iterations=1
    )
    for figures in runs:
        check_kv_sizing(figures)
    errors = [(f["estimate_bytes"] - f["device_bytes"]) / MIB for f in runs]
    benchmark.extra_info.update(
        runs=len(runs),
        out_of_memory=0,  # a run that ran out of memory exits non-zero and fails above
        estimate_error_mib_min=min(errors),
        estimate_error_mib_median=statistics.median(errors),
        estimate_error_mib_max=max(errors),
        leftover_over_margin_mib_min=min((f["left_bytes"] - f["margin_bytes"]) / MIB for f in runs),
        kv_gib=statistics.median(f["kv_bytes"] / 2**30 for f in runs),
        graphs_mib=statistics.median(f["device_bytes"] / MIB for f in runs),
        estimate_s=statistics.median(f["estimate_s"] for f in runs),
        capture_s=statistics.median(f["capture_s"] for f in runs),
    )
