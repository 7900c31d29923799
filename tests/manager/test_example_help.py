"""Every runnable example answers ``--help`` (issue 33): usage and exit 0, quickly, with no CUDA.

The modules are found in the source tree, not listed by hand: a module is
runnable when it has a ``__main__`` guard or statements at its top level
beyond imports, definitions and assignments (a script such as
``in_an_engine``); the others are libraries, reported as skipped with the
reason. Each runs in a fresh interpreter with ``CUDA_VISIBLE_DEVICES`` empty,
so a GPU machine checks the same thing a CPU does.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

_ROOT: Final = Path(__file__).resolve().parents[2]
#: The examples, the repository's top-level ``examples/`` (``python -m examples.demo`` from the root).
_MODULE_FILES: Final = sorted((_ROOT / "examples").rglob("*.py"))
#: Top-level statements a library may hold: they run no program when imported.
_LIBRARY_STATEMENTS: Final = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


def _is_library_statement(node: ast.stmt) -> bool:
    if isinstance(node, _LIBRARY_STATEMENTS):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # a docstring
        return True
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _is_runnable(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return any(_is_main_guard(node) for node in body) or not all(_is_library_statement(n) for n in body)


@pytest.mark.parametrize("path", _MODULE_FILES, ids=_module_name)
def test_every_runnable_example_answers_help(path: Path) -> None:
    if not _is_runnable(path):
        pytest.skip(f"{_module_name(path)} is a library (no __main__, no program at its top level)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", _module_name(path), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=_ROOT,
        check=False,
    )
    assert done.returncode == 0, f"{_module_name(path)} --help: exit {done.returncode}\n{done.stderr[-2000:]}"
    assert done.stdout.startswith("usage: "), done.stdout[:500]


def test_the_runnable_examples_are_the_ones_the_readme_names() -> None:
    """The README's list of runnable examples is the one found here."""
    readme = (_ROOT / "README.md").read_text()
    sentence = readme.split("Every runnable example", 1)[1].split("answers `--help`", 1)[0]
    named = {f"examples.{name}" for name in re.findall(r"`(\w+)`,?", sentence)}
    runnable = {_module_name(path) for path in _MODULE_FILES if _is_runnable(path)}
    assert runnable == named
