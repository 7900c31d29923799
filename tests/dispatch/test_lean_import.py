"""The dispatch layer stays torch-free: engines import it on CPU-only schedulers and in tests."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
import cudagraph_dispatch
print(json.dumps({
    "imported": "cudagraph_dispatch" in sys.modules,
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
}))
"""


def test_import_does_not_load_torch() -> None:
    """In a fresh interpreter, importing cudagraph_dispatch leaves torch (and its submodules) unloaded."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] is True
    assert result["torch"] == []
