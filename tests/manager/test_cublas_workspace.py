"""Graphs keep a valid cuBLAS workspace when torch drops its cache of workspaces.

torch 2.11's ``CUDAGraph.reset`` drops the cached cuBLAS workspace of its
capture stream (pytorch/pytorch#193402), and inductor's CUDA graph trees drop
them all before recording; every graph captured on such a stream may have
baked the dropped workspace in. The engines capture each graph with a workspace
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
def test_a_graph_keeps_its_workspace_when_torch_drops_the_cache(engine: str) -> None:
    stdout = run_fresh("-m", "tests.manager.cublas_workspace_probe", engine)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["fillers_intact"] is True, report
    assert report["max_error"] < 2e-2, report  # relative, bf16: a replay of the same step as eager
