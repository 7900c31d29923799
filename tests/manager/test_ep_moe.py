"""Expert parallelism inside graphs: the DP-attention + EP-MoE decoder on two ranks against its oracle.

Each spawn runs ``tests/manager/ep_worker.py`` on two rank processes under a
hard timeout (``tests.ranks_support``). Every rank draws its own batch size
each step (0, and above the largest capture size, included), runs it through
a manager whose ranks agree every step, and compares its output and the
pairs it dropped with the single-process oracle holding every expert. On
the CPU the ranks exchange over gloo with the fake engines (their replays
run the model, all-to-alls included): a few seconds. On two GPUs the
all-to-alls run over NCCL inside the graphs, 300 steps per case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import torch

from tests.ranks_support import RankRun, spawn_ranks

_WORKER: Final = "tests.manager.ep_worker"
_TIMEOUT_S: Final = 240.0  # per spawn: a hang fails the test instead of stalling the suite
_GPU_STEPS: Final = "300"

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (one per rank)",
)


def _spawn(tmp_path: Path, *args: str) -> RankRun:
    return spawn_ranks(_WORKER, ("ep", *args), world_size=2, timeout_s=_TIMEOUT_S, workdir=tmp_path)


def _routes(run: RankRun) -> set[str]:
    routes: set[str] = set()
    for result in run.results:
        assert isinstance(result["routes"], dict)
        routes |= set(result["routes"])
    return routes


def _check(run: RankRun, *, steps: int, drops: bool) -> None:
    """No mismatch on any rank, the plan refused by name, every rank through the same number of steps."""
    for rank, result in enumerate(run.results):
        print(f"rank {rank}: {result}")
        assert result["steps"] == steps, result
        assert result["mismatches"] == 0, (rank, result)
        compared = result["compared"]
        assert isinstance(compared, int), result
        assert compared >= steps // 2, result
        assert result["dropped"] == result["dropped_expected"], result
        assert str(result["plan"]).startswith("RanksDisagreeError: ranks disagree on the capture plan")
    dropped = sum(int(str(result["dropped"])) for result in run.results)
    assert (dropped > 0) == drops, dropped
    r0, r1 = run.results
    assert r0["captured"] == r1["captured"]
    assert r0["dummy_steps"] or r1["dummy_steps"]  # an idle rank joined the others' all-to-alls


def _check_phased(run: RankRun) -> None:
    """Before the capture every rank ran eagerly; after rank 1 freed its graphs, rank 0 ran eagerly too."""
    r0, r1 = run.results
    for result in run.results:
        before = result["before_capture"]
        assert isinstance(before, dict), result
        assert before.get("not_captured"), result
    reasons0, reasons1 = r0["eager_reasons"], r1["eager_reasons"]
    assert isinstance(reasons0, dict), r0
    assert isinstance(reasons1, dict), r1
    assert reasons0.get("other_rank"), r0
    assert reasons1.get("not_captured"), r1


def _check_background(run: RankRun, *, steps: int) -> None:
    """``start_capture()`` at step 3 on rank 0, step 8 on rank 1: nothing captured before 8, then one key a
    step on both ranks alike, every key captured, the graphs replayed after."""
    r0, r1 = run.results
    assert r0["history"] == r1["history"], (r0["history"], r1["history"])  # the same key in the same step
    history = r0["history"]
    assert isinstance(history, list), r0
    assert history[:9] == [0] * 9, history
    planned = history[-1]
    assert isinstance(planned, int), history
    assert planned > 1, history
    assert history[9 : 9 + planned] == list(range(1, planned + 1)), history  # one key per step from step 8
    for result in run.results:
        assert result["bg_done"] is True, result
        assert result["bg_progress"] == [planned, planned], result
        assert result["bg_errors"] == 0, result
        replays = result["replays"]
        assert isinstance(replays, int), result
        assert replays > steps // 4, result
    routes = _routes(run)
    assert "eager" in routes, routes
    assert routes & {"FULL", "PIECEWISE"}, routes


def test_expert_parallel_decoder_matches_the_oracle_on_cpu(tmp_path: Path) -> None:
    """gloo, fake engines, FULL_AND_PIECEWISE, top-2, capacity factor 1: graphs, eager, dummy, drops."""
    run = _spawn(tmp_path, "cpu", "FULL_AND_PIECEWISE", "2", "1.0", "24", "gloo", "1")
    _check(run, steps=24, drops=True)
    _check_phased(run)
    assert {"FULL", "PIECEWISE", "eager", "dummy_eager", "dummy_PIECEWISE"} <= _routes(run)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize(
    ("mode", "top_k", "capacity", "backend"),
    [
        ("FULL", "2", "exact", "nccl"),
        ("PIECEWISE", "2", "exact", "gloo"),
        ("FULL_AND_PIECEWISE", "2", "exact", "shm"),
        ("FULL_AND_PIECEWISE", "1", "exact", "gloo"),
        ("FULL_AND_PIECEWISE", "2", "1.0", "nccl"),
    ],
)
def test_expert_parallel_decoder_matches_the_oracle_on_two_gpus(
    tmp_path: Path, mode: str, top_k: str, capacity: str, backend: str
) -> None:
    """300 random steps, NCCL all-to-alls inside the graphs: 0 mismatches on both ranks."""
    run = _spawn(tmp_path, "cuda", mode, top_k, capacity, _GPU_STEPS, backend, "0")
    _check(run, steps=int(_GPU_STEPS), drops=capacity != "exact")
    routes = _routes(run)
    graph = "PIECEWISE" if mode == "PIECEWISE" else "FULL"
    assert {graph, f"dummy_{graph}", "eager", "dummy_eager"} <= routes, routes


@pytest.mark.gpu
@two_gpus
def test_expert_parallel_decoder_while_graphs_are_missing_on_two_gpus(tmp_path: Path) -> None:
    """Uncaptured, then captured, then rank 1's graphs freed, then captured again: every rank in step."""
    run = _spawn(tmp_path, "cuda", "FULL_AND_PIECEWISE", "2", "exact", _GPU_STEPS, "nccl", "1")
    _check(run, steps=int(_GPU_STEPS), drops=False)
    _check_phased(run)


@pytest.mark.gpu
@two_gpus
def test_expert_parallel_decoder_under_background_capture_on_two_gpus(tmp_path: Path) -> None:
    """300 random steps, ``start_capture()`` at its own step on each rank: 0 mismatches, graphs in."""
    run = _spawn(tmp_path, "cuda", "FULL_AND_PIECEWISE", "2", "exact", _GPU_STEPS, "nccl", "bg")
    _check(run, steps=int(_GPU_STEPS), drops=False)
    _check_background(run, steps=int(_GPU_STEPS))
    assert {"FULL", "PIECEWISE", "dummy_FULL", "dummy_eager"} <= _routes(run), _routes(run)
