"""``make clean`` leaves nothing the project made: every path ``.gitignore`` lists is gone (issue 33).

Run in a scratch copy of the Makefile, with one file in each ignored place,
so the checkout's own venv and caches are never touched.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Final

import pytest

_REPO: Final = Path(__file__).resolve().parents[1]
#: Ignored paths that are not the project's: the device machinery's output folder.
_NOT_OURS: Final = frozenset({".device-out/"})
#: What the project makes below the root too (Python beside every module, pip in every package).
_NESTED: Final = frozenset({"__pycache__/", "*.egg-info/"})


def _made_paths() -> list[str]:
    """Where the ignored things live, one example path each (a pattern's match, nested where it nests)."""
    paths = []
    for line in (_REPO / ".gitignore").read_text(encoding="utf-8").splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#") or pattern in _NOT_OURS:
            continue
        name = pattern.strip("/").replace("*", "cudagraph_dispatch")
        paths.append(f"{name}/made")
        if pattern in _NESTED:
            paths.append(f"packages/dispatch/src/{name}/made")
    return paths


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_clean_removes_everything_gitignore_lists(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml", ".gitignore"):
        shutil.copy(_REPO / name, tmp_path / name)
    kept = tmp_path / "packages" / "dispatch" / "src" / "cudagraph_dispatch" / "__init__.py"
    kept.parent.mkdir(parents=True)
    kept.write_text("")
    made = _made_paths()
    for path in made:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    result = subprocess.run(
        ["make", "clean"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    left = sorted(path for path in made if (tmp_path / path).exists())
    assert left == [], f"make clean left {left}"
    assert kept.exists(), "make clean removed a source file"
