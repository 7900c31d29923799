"""The dispatch layer stays torch-free: engines import it on CPU-only schedulers and in tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
import {module}
print(json.dumps({{
    "imported": "{module}" in sys.modules,
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
}}))
"""


@pytest.mark.parametrize(
    "module", ["cudagraph_dispatch", "cudagraph_dispatch.support", "cudagraph_dispatch.lowlevel"]
)
def test_import_does_not_load_torch(module: str) -> None:
    """In a fresh interpreter, importing the package or a tier of it loads no torch module."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] is True
    assert result["torch"] == []
