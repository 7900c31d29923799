"""Importing the torch packages must not initialize CUDA.

Importing is what a process does before it forks workers or picks a device;
a CUDA context created at import time breaks both. Meaningful without a GPU
too, so these tests carry no ``gpu`` mark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

_REPO = Path(__file__).resolve().parents[2]
_SRC_DIRS = [_REPO / "packages" / name / "src" for name in ("dispatch", "capture", "manager")]

_PROBE = """
import json, sys
import {module}
import torch
print(json.dumps({{"cuda_initialized": torch.cuda.is_initialized(), "loaded": "{module}" in sys.modules}}))
"""


def subprocess_env() -> dict[str, str]:
    """The environment of a probe interpreter: the three src folders and the repo on its path."""
    paths = [str(p) for p in (*_SRC_DIRS, _REPO)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run_fresh(*args: str, timeout: float = 300) -> str:
    """``python *args`` in a fresh interpreter with the packages on its path; its stdout (it must succeed)."""
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def fresh_json(*args: str, timeout: float = 300) -> dict[str, Any]:
    """The JSON object that ``python *args``, run in a fresh interpreter, prints last."""
    report: dict[str, Any] = json.loads(run_fresh(*args, timeout=timeout).strip().splitlines()[-1])
    return report


def probe(code: str) -> dict[str, object]:
    """The JSON object that ``code``, run in a fresh interpreter, prints last."""
    return fresh_json("-c", code)


@pytest.mark.parametrize("module", ["cudagraph_capture", "cudagraph_capture.lowlevel", "cudagraph_manager"])
def test_import_does_not_initialize_cuda(module: str) -> None:
    """``import {module}`` in a fresh interpreter leaves ``torch.cuda.is_initialized()`` False."""
    assert probe(_PROBE.format(module=module)) == {"cuda_initialized": False, "loaded": True}


_BINDINGS_PROBE = """
import json, sys
import torch

def bindings():
    return {m for m in sys.modules if m == "cuda.bindings" or m.startswith("cuda.bindings.")}

before = bindings()  # what torch itself imported (a torch built with cuda-bindings may)
import cudagraph_capture
from cudagraph_capture import BreakableCUDAGraphWrapper, CUDAGraphWrapper, DeviceLoop
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode

def forward(x):
    return x * 2

monolithic = CUDAGraphWrapper(forward, CUDAGraphMode.FULL)
breakable = BreakableCUDAGraphWrapper(forward)
try:
    DeviceLoop.capture(forward, stop=torch.zeros((), dtype=torch.bool), max_steps=4)  # a CPU flag
except ValueError:
    pass
if torch.cuda.is_available():  # the other engines capture and replay
    x = torch.ones(4, device="cuda")
    for engine in (monolithic, breakable):
        engine.capture(BatchDescriptor(4), x)
        engine.replay(BatchDescriptor(4))
    torch.cuda.synchronize()
print(json.dumps({"new": sorted(bindings() - before)}))
"""


def test_cuda_bindings_are_imported_only_by_a_device_loop() -> None:
    """Neither ``import cudagraph_capture`` nor the other engines import cuda-bindings (the loop engine's)."""
    assert probe(_BINDINGS_PROBE) == {"new": []}
