"""Two GPUs: the DP-attention + EP-MoE decoder per step (graph, eager), the agreement, the capacity's memory.

Two rank processes of ``tests/benchmarks/ep_moe.py`` (spawned by hand, under
a hard timeout: see ``tests.ranks_support``); rank 0's figures go to
``extra_info``. Quoted in docs/several-gpus.md, not asserted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import torch

from tests.benchmarks.support import BenchmarkFixture
from tests.benchmarks.test_bench_multi_gpu import _flat
from tests.ranks_support import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices (one per rank)",
    ),
]

_TIMEOUT_S: Final = 420.0


def test_bench_expert_parallel_two_gpus(benchmark: BenchmarkFixture, tmp_path: Path) -> None:
    results: list[dict[str, object]] = []
    benchmark.group = "two GPUs: DP attention + EP MoE (all-to-alls in the graph), rank agreement"

    def spawn() -> None:
        run = spawn_ranks(
            "tests.benchmarks.ep_moe", ["ep"], world_size=2, timeout_s=_TIMEOUT_S, workdir=tmp_path
        )
        results.append(run.results[0])

    benchmark.pedantic(spawn, rounds=1, iterations=1)
    (rank0,) = results
    benchmark.extra_info.update(_flat(rank0))
