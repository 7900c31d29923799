"""Ranks whose graphs differ (issue 54): a lockstep capture that never stalls, one rank's graphs back.

Two rank processes of the expert-parallel decoder (its all-to-alls run in
every step, warm-up and recording), each under a hard timeout
(``tests.ranks_support``): every combination the API allows runs in one
spawn (``tests/manager/differ_worker.py``), each real step compared with the
single-process oracle. A rank taking another way than its peer would leave
the peer in a collective (the timeout fails the test) or make gloo abort on
rows of another size; the two ranks' logs of every exchange's width must be
equal. On the CPU over gloo with the fake engines; on two GPUs over NCCL,
the all-to-alls inside the graphs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import torch

from cudagraph_manager.ranks._shared_table import shared_memory_supported
from tests.ranks_support import RankRun, spawn_ranks

_WORKER: Final = "tests.manager.differ_worker"
_TIMEOUT_S: Final = 240.0  # per spawn: a hang fails the test instead of stalling the suite

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (one per rank)",
)
one_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (both ranks share it)"
)

#: Facts both ranks report alike after each combination (each ends with every key captured again).
_CONVERGED: Final = (
    "capture",
    "cleared",
    "released",
    "stopped_again",
    "stop_wait_again",
    "fault_invalidated_again",
    "fault_model_error_again",
    "late",
    "one_waits",
    "released_midway_again",
    "capture_after_clear",
)


def _spawn(tmp_path: Path, *args: str) -> RankRun:
    return spawn_ranks(_WORKER, args, world_size=2, timeout_s=_TIMEOUT_S, workdir=tmp_path)


def _fact(run: RankRun, rank: int, name: str) -> dict[str, object]:
    fact = run.results[rank][name]
    assert isinstance(fact, dict), (name, fact)
    return fact


def _check(run: RankRun) -> None:
    r0, r1 = run.results
    planned = r0["planned"]
    assert isinstance(planned, int), r0
    # Every collective entered by both ranks, in the same order, with rows of one shape.
    assert r0["widths"] == r1["widths"], (r0["widths"], r1["widths"])
    for rank, result in enumerate(run.results):
        print(f"rank {rank}: { {k: v for k, v in result.items() if k != 'widths'} }")
        assert result["mismatches"] == 0, (rank, result)
        compared = result["compared"]
        assert isinstance(compared, int), result
        assert compared >= 20, result
    # After each combination every rank serves from graphs again: all keys, a probe step replays.
    for name in _CONVERGED:
        f0, f1 = _fact(run, 0, name), _fact(run, 1, name)
        assert f0 == f1, (name, f0, f1)
        assert f0["captured"] == planned, (name, f0)
        assert f0["probe_replayed"] is True, (name, f0)
        if "progress" in f0:
            assert f0["done"] is True, (name, f0)
    # One rank's clear(): the union captured in lockstep, one key a step then the rest in wait().
    assert _fact(run, 0, "cleared")["progress"] == [planned, planned]
    assert r0["released_steps"] == r1["released_steps"] == -(-planned // 2)  # two keys a step
    # A stop on rank 1 ended both captures at the next step: one key captured in the step before.
    s0, s1 = _fact(run, 0, "stopped"), _fact(run, 1, "stopped")
    assert (s0["done"], s1["done"]) == (True, True), (s0, s1)
    assert (s0["captured"], s1["captured"]) == (1, planned), (s0, s1)
    w0, w1 = _fact(run, 0, "stop_wait"), _fact(run, 1, "stop_wait")
    assert (w0["done"], w1["done"], w0["captured"]) == (True, True, 0), (w0, w1)
    # A fault on rank 1: an invalidated recording tried again by both; the model's own error given up
    # by both (the key dropped on both), then captured by the next lockstep capture.
    i0, i1 = _fact(run, 0, "fault_invalidated"), _fact(run, 1, "fault_invalidated")
    assert i0 == i1 == {"captured": planned, "errors": 0, "retries": 1}, (i0, i1)
    m0, m1 = _fact(run, 0, "fault_model_error"), _fact(run, 1, "fault_model_error")
    assert m0 == m1 == {"captured": planned - 1, "errors": 1, "retries": 0}, (m0, m1)
    # Started late: rank 0's capture waited (holding every key: it never ended alone), then both.
    assert _fact(run, 0, "late_waiting") == {"captured": planned, "done": False}
    assert _fact(run, 1, "late_waiting") == {"captured": 0, "done": None}
    assert r0["late_steps"] == r1["late_steps"] == planned
    assert _fact(run, 0, "released_midway") == _fact(run, 1, "released_midway") == {"done": True}
    # The shared-memory backend takes rows of any width, as gloo and NCCL do (x86-64, on the CPU).
    for result in run.results:
        shm = result.get("shm_rows", {})
        assert isinstance(shm, dict), result
        for width, got in shm.items():
            assert got == [[r * 1000 + i for i in range(int(width))] for r in range(2)], (width, got)


def test_ranks_whose_graphs_differ_converge_in_lockstep_on_cpu(tmp_path: Path) -> None:
    """gloo, fake engines: every combination, 0 hangs, 0 mismatched collectives, 0 oracle mismatches.

    Then rows of any width over the shared-memory backend (the table grows on both ranks alike).
    """
    run = _spawn(tmp_path, "combinations", "ep", "cpu", "gloo")
    _check(run)
    if shared_memory_supported() is None:
        for result in run.results:
            shm = result["shm_rows"]
            assert isinstance(shm, dict), result
            assert len(shm) == 5, shm


@pytest.mark.gpu
@one_gpu
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_ranks_whose_graphs_differ_converge_in_lockstep_on_one_gpu(tmp_path: Path, backend: str) -> None:
    """Both ranks on one GPU, the real engines: the toy model's gloo all-reduce runs in every recording."""
    _check(_spawn(tmp_path, "combinations", "toy", "shared_cuda", backend))


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_ranks_whose_graphs_differ_converge_in_lockstep_on_two_gpus(tmp_path: Path, backend: str) -> None:
    """The expert-parallel decoder, NCCL's all-to-alls inside the graphs, the real engines."""
    _check(_spawn(tmp_path, "combinations", "ep", "cuda", backend))
