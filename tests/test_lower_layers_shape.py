"""The lower layers' shape: dispatch, capture and the manager's ``ranks`` keep to tighter limits.

Functions of at most ``MAX_FUNCTION_LINES`` lines (docstring included) and
``MAX_PARAMETERS`` parameters (``self`` and ``cls`` not counted, ``*args``
and ``**kwargs`` one each), classes of at most ``MAX_CLASS_LINES`` lines.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
FOLDERS: Final = (
    ROOT / "packages/dispatch/src",
    ROOT / "packages/capture/src",
    ROOT / "packages/manager/src/cudagraph_manager/ranks",
)
MAX_FUNCTION_LINES: Final = 40
MAX_CLASS_LINES: Final = 250
MAX_PARAMETERS: Final = 6


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    arguments = node.args
    names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (arguments.vararg is not None) + (arguments.kwarg is not None)


def _too_large(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        assert node.end_lineno is not None
        lines = node.end_lineno - node.lineno + 1
        where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        if isinstance(node, ast.ClassDef):
            if lines > MAX_CLASS_LINES:
                found.append(f"{where}: {lines} lines")
        elif lines > MAX_FUNCTION_LINES or _parameters(node) > MAX_PARAMETERS:
            found.append(f"{where}: {lines} lines, {_parameters(node)} parameters")
    return found


def test_the_lower_layers_keep_their_functions_and_classes_small() -> None:
    sources = [path for folder in FOLDERS for path in sorted(folder.rglob("*.py"))]
    assert len(sources) > 30, sources
    found = [hit for path in sources for hit in _too_large(path)]
    assert not found, found
