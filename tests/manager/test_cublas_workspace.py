"""Graphs keep a valid cuBLAS workspace when another graph on their capture stream is destroyed.

torch 2.11's ``CUDAGraph.reset`` drops the cached cuBLAS workspace of its
capture stream (pytorch/pytorch#193402), which every graph captured on that
stream may have baked in. The engines capture each graph with a workspace
of the graph pool's (``_segment``'s notes). Each probe runs in a fresh
interpreter: a freed workspace can crash the CUDA context for good. With
``--unfixed`` (the engines' handling off) the same probe dies of an illegal
memory access on an H200, in both modes: this test can fail.
"""

from __future__ import annotations

import json

import pytest

from tests.capture.test_lean_import_capture import run_fresh

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("engine", ["FULL", "PIECEWISE"])
def test_discarding_a_graph_leaves_the_others_workspace_alone(engine: str) -> None:
    stdout = run_fresh("-m", "tests.manager.cublas_workspace_probe", engine)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["fillers_intact"] is True, report
    assert report["max_error"] < 2e-2, report  # relative, bf16: a replay of the same step as eager
