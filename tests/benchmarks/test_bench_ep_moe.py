"""Two GPUs: the DP-attention + EP-MoE decoder per step (graph, eager), the agreement, the capacity's memory.

Two rank processes of ``tests/benchmarks/ep_moe.py`` (spawned by hand, under
a hard timeout: see ``tests.ranks_support``); rank 0's figures go to
``extra_info``. Quoted in docs/several-gpus.md, not asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.support import BenchmarkFixture
from tests.benchmarks.test_bench_multi_gpu import TWO_GPUS, bench_two_ranks

pytestmark = [pytest.mark.gpu, TWO_GPUS]


def test_bench_expert_parallel_two_gpus(benchmark: BenchmarkFixture, tmp_path: Path) -> None:
    bench_two_ranks(
        benchmark,
        tmp_path,
        "tests.benchmarks.ep_moe",
        ["ep"],
        "two GPUs: DP attention + EP MoE (all-to-alls in the graph), rank agreement",
    )
