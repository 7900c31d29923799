"""Managers on several ranks (``RankAgreement``): two rank processes per test, each under a hard timeout.

On the CPU the ranks talk over gloo and capture with the fake engines, which
runs every line of the agreement here. On one GPU the data-parallel and
capture-fault scenarios run with the real engines, both ranks on that GPU
(each with its own graphs; the model's collective over gloo, outside the
graphs), agreeing over gloo and shm: every GPU run exercises them. With two
GPUs they also run one rank per GPU, over NCCL too, and a tensor-parallel
reference decoder (NCCL all-reduces inside the graphs) is compared with the
unsharded one.
"""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
import torch

from cudagraph_manager.ranks import RankAgreement
from cudagraph_manager.ranks._shared_table import make_table_file, shared_memory_supported
from tests.capture.test_lean_import_capture import run_fresh, subprocess_env
from tests.manager.helpers import TOL
from tests.ranks_support import RankRun, spawn_ranks

_WORKER: Final = "tests.manager.rank_worker"
_TIMEOUT_S: Final = 150.0  # per spawn: a hang fails the test instead of stalling the suite
_MIB: Final = 2**20

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (one per rank)",
)
one_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (both ranks share it)"
)

#: The worker's device kind for each GPU layout: both ranks on GPU 0, or rank ``r`` on GPU ``r``.
_LAYOUTS: Final = {"one_gpu": "shared_cuda", "two_gpus": "cuda"}


def _spawn(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> RankRun:
    return spawn_ranks(_WORKER, args, world_size=2, timeout_s=_TIMEOUT_S, workdir=tmp_path, env=env)


def _check_layout(run: RankRun, layout: str) -> None:
    """Both ranks on GPU 0 (the same physical GPU), or rank ``r`` on GPU ``r`` (different GPUs)."""
    r0, r1 = run.results
    if layout == "one_gpu":
        assert (r0["device"], r1["device"]) == ("cuda:0", "cuda:0")
        assert r0["gpu"] == r1["gpu"] != "", (r0["gpu"], r1["gpu"])
    else:
        assert (r0["device"], r1["device"]) == ("cuda:0", "cuda:1")
        assert r0["gpu"] != r1["gpu"], (r0["gpu"], r1["gpu"])


def _case(run: RankRun, name: str, rank: int) -> dict[str, object]:
    case = run.results[rank][name]
    assert isinstance(case, dict)
    return case


@functools.cache
def _expected() -> dict[str, tuple[dict[str, object], dict[str, object]]]:
    """What each ``DP_CASES`` step must do on rank 0 and rank 1 (FULL_AND_PIECEWISE, sizes 1..32)."""
    return {
        # 3 uniform + 13 mixed: mixed, padded to the larger one's key.
        "unequal": (
            {"replayed": ["PIECEWISE:16"], "padded_tokens": 13, "rows": 3},
            {"replayed": ["PIECEWISE:16"], "padded_tokens": 3, "rows": 13},
        ),
        # The idle rank replays the same graph on pad values: the dummy step.
        "one_idle": (
            {"replayed": ["PIECEWISE:8"], "dummy_steps": 0, "rows": 5},
            {"replayed": ["PIECEWISE:8"], "dummy_steps": 1, "padded_tokens": 8, "rows": 0},
        ),
        # Above the largest size on one rank: both eager, each saying why.
        "above_largest": (
            {"replayed": [], "eager_reasons": {"other_rank": 1}, "rows": 4},
            {"replayed": [], "eager_reasons": {"above_largest_size": 1}, "rows": 40},
        ),
        # FULL invalid on rank 0 is invalid on both: both fall back to PIECEWISE.
        "invalid_on_one": (
            {"replayed": ["PIECEWISE:4"], "rows": 4},
            {"replayed": ["PIECEWISE:4"], "rows": 4},
        ),
        "all_idle": (
            {"replayed": [], "idle_steps": 1, "dummy_steps": 0, "rows": 0},
            {"replayed": [], "idle_steps": 1, "dummy_steps": 0, "rows": 0},
        ),
        "equal_uniform": (
            {"replayed": ["FULL:8"], "padded_tokens": 2, "rows": 6},
            {"replayed": ["FULL:8"], "padded_tokens": 0, "rows": 8},
        ),
        # The idle rank runs the model on one padding row: the others' collectives meet it.
        "idle_while_eager": (
            {"replayed": [], "eager_reasons": {"above_largest_size": 1}, "dummy_steps": 0, "rows": 40},
            {"replayed": [], "eager_reasons": {}, "dummy_steps": 1, "idle_steps": 0, "rows": 0},
        ),
    }


def _check_data_parallel(run: RankRun) -> None:
    r0, r1 = run.results
    assert r0["captured"] == r1["captured"]
    # Every model call holds a collective of both ranks: equal counts, or a rank would have waited.
    assert r0["model_calls"] == r1["model_calls"]
    # Rank 1 cleared its graphs: rank 0 must not replay, even with rank 1 idle.
    assert r0["after_clear_idle"] == {
        "replayed": [],
        "eager_reasons": {"other_rank": 1},
        "dummy_steps": 0,
        "rows": 5,
    }
    assert r1["after_clear_idle"] == {"replayed": [], "eager_reasons": {}, "dummy_steps": 1, "rows": 0}
    assert r0["after_clear"]["eager_reasons"] == {"other_rank": 1}  # type: ignore[index]
    assert r1["after_clear"]["eager_reasons"] == {"not_captured": 1}  # type: ignore[index]
    for name, per_rank in _expected().items():
        for rank, expected in enumerate(per_rank):
            case = _case(run, name, rank)
            for field, value in expected.items():
                assert case[field] == value, f"{name}, rank {rank}: {field} = {case[field]!r}, not {value!r}"
            err = case["err"]
            assert isinstance(err, float), err
            assert err < TOL, f"{name}, rank {rank}: error {err} against eager"


def _check_faults(run: RankRun) -> None:
    r0, r1 = run.results
    for result in (r0, r1):
        assert str(result["mismatch"]).startswith("RanksDisagreeError: ranks disagree on the capture plan")
        assert str(result["mismatch_estimate"]).startswith(
            "RanksDisagreeError: ranks disagree on the capture plan"
        )
        assert str(result["disabled_estimate"]).startswith(
            "RanksDisagreeError: ranks disagree on whether to capture"
        )
        assert result["mismatch_captured"] == 0
        assert str(result["disabled"]).startswith("RanksDisagreeError: ranks disagree on whether to capture")
        assert "rank(s) [1] cannot capture" in str(result["disabled"])
        assert result["disabled_captured"] == 0
    assert "planted capture failure" in str(r1["failure"])
    assert str(r0["failure"]).startswith("CaptureError: rank(s) [1] of 2 failed to capture this key")
    # Both ranks kept the two keys captured before the failure, and dropped the third.
    assert r0["failure_captured"] == r1["failure_captured"] == 2
    assert r0["recaptured"] == r1["recaptured"] == 7  # FULL over sizes 1, 2, 4, 8, 16, 24, 32
    for result in (r0, r1):
        _check_lockstep(result)
        assert result["after_replayed"] == ["FULL:8"]
        err = result["after_err"]
        assert isinstance(err, float), err
        assert err < TOL


def _check_lockstep(result: dict[str, object]) -> None:
    """``start_capture()`` with ranks: the keys captured two a step once both ranks started (step 3)."""
    # Steps 0-2: rank 1 has not started; 3-6: two keys a step (the failed one again); then all 7.
    assert result["lockstep_captured"] == [0, 0, 0, 2, 4, 6, 7, 7, 7, 7], result
    assert result["lockstep_replayed"] == ["FULL:8"], result  # steps 7-9, once every key was captured
    assert result["lockstep_graphs"] == 7, result
    assert result["lockstep_retries"] == 1, result  # rank 1's planted failure, tried again on both ranks
    assert result["lockstep_errors"] == 0, result
    assert result["lockstep_progress"] == [7, 7], result
    assert result["lockstep_wait_graphs"] == 7, result
    for key in ("lockstep_err", "lockstep_wait_err"):
        err = result[key]
        assert isinstance(err, float), result
        assert err < TOL, result


def test_an_agreement_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        RankAgreement()


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_data_parallel_agreement_on_cpu(tmp_path: Path, backend: str) -> None:
    """Unequal, idle, above-largest and invalid-mode steps: every rank runs the same thing."""
    if backend == "shm" and (why := shared_memory_supported()) is not None:
        pytest.skip(why)
    run = _spawn(tmp_path, "dp", "cpu", backend)
    assert run.results[0]["backend"] == backend
    _check_data_parallel(run)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_data_parallel_agreement_without_numpy(tmp_path: Path, backend: str) -> None:
    """A clean install (the wheels and a CPU torch) has no numpy: the agreements must not need it."""
    if backend == "shm" and (why := shared_memory_supported()) is not None:
        pytest.skip(why)
    run = _spawn(tmp_path, "dp", "cpu", backend, env={"CUDAGRAPH_TEST_BLOCK_NUMPY": "1"})
    assert run.results[0]["backend"] == backend
    _check_data_parallel(run)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_rank_that_never_arrives_fails_the_others_after_the_timeout(tmp_path: Path, backend: str) -> None:
    if backend == "shm" and (why := shared_memory_supported()) is not None:
        pytest.skip(why)
    result = _spawn(tmp_path, "late", backend).results[0]
    assert result["late"] != "no error", result
    waited = result["waited_s"]
    assert isinstance(waited, float), result
    assert 0.75 < waited < 2.75, result  # the 1 s timeout, not rank 1's return after 3 s
    assert result["late"] == "TimeoutError", result  # ours, naming the ranks, not torch's raw error
    if backend == "shm":
        assert "rank 1 did not reach exchange 2" in str(result["message"])
    else:
        assert "rank 0 of 2: the exchange over gloo timed out after 1 s" in str(result["message"])


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_agreements_of_subgroups_are_built_by_their_members_alone(tmp_path: Path, backend: str) -> None:
    """Data-parallel groups of a bigger world: each group's ranks build theirs, the others do not wait."""
    if backend == "shm" and (why := shared_memory_supported()) is not None:
        pytest.skip(why)
    run = spawn_ranks(_WORKER, ("subgroups", backend), world_size=4, timeout_s=_TIMEOUT_S, workdir=tmp_path)
    for rank, result in enumerate(run.results):
        low = 2 * (rank // 2)  # the group's first global rank
        assert result["group_rank"] == rank % 2
        assert result["world_size"] == 2
        assert result["rows"] == [[low, 10 * low], [low + 1, 10 * (low + 1)]]
        # The newcomer's 2: a failure inside torch, different on each rank, before.
        assert result["bad_row"] == "row: expected a list or tuple of ints (one at least), got 'abc'"


def test_a_shared_table_one_rank_cannot_open_fails_every_rank(tmp_path: Path) -> None:
    if (why := shared_memory_supported()) is not None:
        pytest.skip(why)
    for result in _spawn(tmp_path, "shm_refused").results:
        refused = str(result["refused"])
        assert refused.startswith("backend: the shared-memory table could not be set up: rank 1 could not")
        assert "Permission denied" in refused


def test_capture_faults_across_ranks_on_cpu(tmp_path: Path) -> None:
    """A mismatched plan, a rank that cannot capture, a failed capture: every rank raises, none hangs."""
    _check_faults(_spawn(tmp_path, "faults", "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("layout", "backend"),
    [
        pytest.param("one_gpu", "gloo", marks=one_gpu),
        pytest.param("one_gpu", "shm", marks=one_gpu),
        pytest.param("two_gpus", "gloo", marks=two_gpus),
        pytest.param("two_gpus", "nccl", marks=two_gpus),
        pytest.param("two_gpus", "shm", marks=two_gpus),
    ],
)
def test_data_parallel_agreement_on_gpus(tmp_path: Path, layout: str, backend: str) -> None:
    """The CPU test's steps with real graphs on both ranks, each replay against eager on fresh inputs.

    ``one_gpu``: two processes share GPU 0 (NCCL refuses that, so gloo and
    shm only); ``two_gpus``: one GPU per rank, NCCL in the graphs.
    """
    if backend == "shm" and (why := shared_memory_supported()) is not None:
        pytest.skip(why)
    run = _spawn(tmp_path, "dp", _LAYOUTS[layout], backend)
    _check_layout(run, layout)
    assert run.results[0]["backend"] == backend
    _check_data_parallel(run)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout",
    [pytest.param("one_gpu", marks=one_gpu), pytest.param("two_gpus", marks=two_gpus)],
)
def test_capture_faults_across_ranks_on_gpus(tmp_path: Path, layout: str) -> None:
    """Mismatched plans, a rank that cannot capture, a failed capture, with real graphs: every rank raises."""
    run = _spawn(tmp_path, "faults", _LAYOUTS[layout])
    _check_layout(run, layout)
    _check_faults(run)


def _check_tensor_parallel(run: RankRun) -> None:
    for rank, result in enumerate(run.results):
        for mode in ("FULL", "PIECEWISE", "FULL_AND_PIECEWISE"):
            facts = result[mode]
            assert isinstance(facts, dict)
            assert facts["captured"] == facts["planned"], (rank, mode, facts)
            assert facts["eager_steps"] == 0, (rank, mode, facts)  # strict: a step without a graph raises
            assert facts["replays"] == facts["steps"], (rank, mode, facts)
            assert facts["max_err"] < TOL, (rank, mode, facts)


def test_tensor_parallel_decoder_matches_unsharded_on_cpu(tmp_path: Path) -> None:
    """TP=2 over gloo, fake engines: the sharding and the all-reduces give the unsharded result."""
    _check_tensor_parallel(_spawn(tmp_path, "tp", "cpu"))


@pytest.mark.gpu
@two_gpus
def test_tensor_parallel_decoder_matches_unsharded(tmp_path: Path) -> None:
    """TP=2 in FULL, PIECEWISE and FULL_AND_PIECEWISE: every step replays and equals one GPU's result."""
    _check_tensor_parallel(_spawn(tmp_path, "tp", "cuda"))


@pytest.mark.gpu
@two_gpus
def test_the_estimate_predicts_a_tensor_parallel_capture(tmp_path: Path) -> None:
    """TP=2, FULL_AND_PIECEWISE over 51 sizes, graphs with NCCL all-reduces: issue 17's target per rank.

    Within max(1.5%, 32 MiB) of the drop the capture's report measured, never
    more than 32 MiB under. (Its time share is a benchmark figure, printed.)
    """
    run = _spawn(tmp_path, "tp_memory", "cuda")
    for rank, facts in enumerate(run.results):
        estimate, measured = facts["estimate_bytes"], facts["measured_bytes"]
        assert isinstance(estimate, int), facts
        assert isinstance(measured, int), facts
        error = estimate - measured
        print(f"rank {rank}: {facts}; error {error / _MIB:+.1f} MiB")
        assert facts["graphs"] == 86, facts
        assert error >= -32 * _MIB, (rank, facts)
        assert abs(error) <= max(0.015 * measured, 32 * _MIB), (rank, facts)


def _check_example(stdout: str, steps: int) -> None:
    assert f"{steps} steps on 2 ranks" in stdout, stdout
    worst = float(stdout.rsplit("largest difference from the unsharded decoder: ", 1)[1].split()[0])
    assert worst < 1e-4, stdout


def test_the_several_gpus_example_runs_on_cpu() -> None:
    """The README's example over gloo on the CPU: the sharded decoder agrees with the unsharded one.

    Its eager steps are ``no_cuda`` (an INFO line), not a warning that its
    graphs were "not captured" (the newcomer's 1).
    """
    done = subprocess.run(
        [sys.executable, "-m", "examples.several_gpus", "--device", "cpu", "--steps", "6"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "6 steps on 2 ranks agreeing over gloo: 0 replayed, 6 eager" in done.stdout
    assert "not_captured" not in done.stderr
    _check_example(done.stdout, 6)


@pytest.mark.gpu
@two_gpus
def test_the_several_gpus_example_runs_on_two_gpus() -> None:
    stdout = run_fresh("-m", "examples.several_gpus", "--device", "cuda", "--steps", "32")
    assert "32 steps on 2 ranks agreeing over gloo: 32 replayed, 0 eager" in stdout
    _check_example(stdout, 32)


def test_the_shared_table_file_is_new_and_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    """Made exclusive and 0600 (the review: ``open(path, "wb")`` took the umask, 0666 under umask 0)."""
    path = tmp_path / "table"
    previous = os.umask(0)
    try:
        make_table_file(str(path), 64)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 64
    with pytest.raises(FileExistsError):  # a planted file of that name is never opened instead
        make_table_file(str(path), 64)
