"""Two GPUs: the tensor-parallel reference decoder per step, and what the rank agreement costs.

Two rank processes of ``tests/benchmarks/multi_gpu.py`` (spawned by hand,
under a hard timeout: see ``tests.ranks_support``); rank 0's figures go to
``extra_info``: per batch (1, 16, 128) the median step time of eager, a
hand-written graph, the manager in FULL and PIECEWISE, and the FULL manager
agreeing every step over gloo and NCCL, with the ratios the targets name;
then one ``RankAgreement.agree_step`` alone, per backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import torch

from tests.benchmarks.support import BenchmarkFixture
from tests.ranks_support import spawn_ranks

#: Rank processes need a CUDA device each.
TWO_GPUS: Final = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (one per rank)",
)
pytestmark = [pytest.mark.gpu, TWO_GPUS]

_TIMEOUT_S: Final = 420.0


def bench_two_ranks(
    benchmark: BenchmarkFixture, workdir: Path, module: str, args: list[str], group: str
) -> None:
    """One round of ``module``'s two rank processes (``args``); rank 0's figures into ``extra_info``."""
    results: list[dict[str, object]] = []
    benchmark.group = group

    def spawn() -> None:
        run = spawn_ranks(module, args, world_size=2, timeout_s=_TIMEOUT_S, workdir=workdir)
        results.append(run.results[0])

    benchmark.pedantic(spawn, rounds=1, iterations=1)
    (rank0,) = results
    benchmark.extra_info.update(_flat(rank0))


def test_bench_tensor_parallel_two_gpus(benchmark: BenchmarkFixture, tmp_path: Path) -> None:
    bench_two_ranks(
        benchmark,
        tmp_path,
        "tests.benchmarks.multi_gpu",
        ["tp"],
        "two GPUs: tensor-parallel reference decoder (TP=2), rank agreement",
    )


def _flat(result: dict[str, object], prefix: str = "") -> dict[str, object]:
    """Nested figures as one level of keys (``batch16_median_us_eager``): the report's columns are scalars."""
    flat: dict[str, object] = {}
    for key, value in result.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}_"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
