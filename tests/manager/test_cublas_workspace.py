"""Graphs keep a valid cuBLAS workspace when torch drops its cache of workspaces.

torch 2.11's ``CUDAGraph.reset`` drops the cached cuBLAS workspace of its
capture stream (pytorch/pytorch#193402), and inductor's CUDA graph trees drop
them all before recording; every graph captured on such a stream may have
baked the dropped workspace in. The engines capture each graph with a workspace
of the graph pool's (``_segment``'s notes). Each probe runs in a fresh
interpreter: a freed workspace can crash the CUDA context for good. With
``--unfixed`` (the engines' handling off) the same probe dies of an illegal
memory access on an H200, in both modes: the second test checks that.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.capture.test_lean_import_capture import run_fresh, subprocess_env

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("engine", ["FULL", "PIECEWISE"])
def test_a_graph_keeps_its_workspace_when_torch_drops_the_cache(engine: str) -> None:
    stdout = run_fresh("-m", "tests.manager.cublas_workspace_probe", engine)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["fillers_intact"] is True, report
    assert report["max_error"] < 2e-2, report  # relative, bf16: a replay of the same step as eager


@pytest.mark.parametrize("engine", ["FULL", "PIECEWISE"])
def test_without_the_fix_the_probe_sees_the_freed_workspace(engine: str) -> None:
    """The negative control: with the handling off, the probe crashes or reports the damage."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.manager.cublas_workspace_probe", engine, "--unfixed"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
        check=False,
    )
    if done.returncode == 0:
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["fillers_intact"] is False or report["max_error"] >= 2e-2, report
    else:
        assert "illegal memory access" in done.stderr, done.stderr[-2000:]
