"""``make clean`` leaves nothing the project made: every path ``.gitignore`` lists is gone (issue 33).

Run in a scratch copy of the Makefile, with one file in each ignored place,
so the checkout's own venv and caches are never touched.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
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


# -- targets that use an existing python say what it lacks (issue 39) --


def _python_without(tmp_path: Path, modules: tuple[str, ...]) -> Path:
    """A stand-in python: this one, with ``modules`` made unimportable (a sitecustomize that hides them)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {modules!r}:\n"
        "    sys.modules[name] = None  # importlib.util.find_spec(name) is then None: missing\n"
    )
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{hide}:$PYTHONPATH" exec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return script


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(
    ("target", "named"),
    [
        ("gpu-test", "torch, hypothesis, pytest-benchmark"),
        ("gpu-bench", "torch, pytest-benchmark"),
        ("soak", "torch"),
    ],
)
def test_a_target_with_a_python_that_lacks_a_module_names_it_before_running(
    tmp_path: Path, target: str, named: str
) -> None:
    """``make gpu-test PYTHON=...`` with no torch: one message naming the python and what it lacks, exit 2.

    Before, each test module failed with its own import error (and the bench
    report called the errored modules "skipped").
    """
    python = _python_without(tmp_path, ("torch", "hypothesis", "pytest_benchmark"))
    result = subprocess.run(
        ["make", "--no-print-directory", target, f"PYTHON={python}"],
        cwd=_REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"make {target}: " in result.stderr
    assert f"cannot import {named}, which `make {target}` needs" in result.stderr
    assert "Traceback" not in result.stderr
    assert "collected" not in result.stdout  # pytest never started
