"""The package code's shape, checked on its syntax trees: the budgets past which code signals trouble.

- No function or method of package code is longer than ``MAX_FUNCTION_LINES``
  or takes more than ``MAX_PARAMETERS`` (``self`` and ``cls`` not counted),
  and no class is longer than ``MAX_CLASS_LINES``. These are budgets, not
  targets (docs/design.md, "Conventions"): past one, look again; below them,
  nothing is split or squeezed to move a number.
- A ``._name`` read names the private state of an object of the same module
  (a class defined there sets or declares it) or of torch (its private API,
  where no public one exists). Reading another module's private state couples
  the two modules to a shape neither states; a public accessor says what is
  shared.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parents[1]
SOURCES: Final = sorted((ROOT / "packages").glob("*/src/**/*.py"))
EXAMPLES: Final = sorted((ROOT / "examples").rglob("*.py"))
MAX_FUNCTION_LINES: Final = 60
MAX_PARAMETERS: Final = 8
MAX_CLASS_LINES: Final = 400
#: Private names of torch objects read without a ``torch.`` prefix: (file name, attribute) -> why.
TORCH_PRIVATE: Final = {
    ("_weights.py", "_parameters"): "nn.Module's own parameters, without the named_parameters() walk",
}


def _trees(paths: list[Path] = SOURCES) -> Iterator[tuple[Path, ast.Module]]:
    for path in paths:
        yield path, ast.parse(path.read_text(), str(path))


def _lines(node: ast.AST) -> int:
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def test_the_sources_are_found() -> None:
    assert len(SOURCES) > 40, SOURCES
    assert len(EXAMPLES) > 15, EXAMPLES
    assert not [path for path in SOURCES if "examples" in path.parts], "examples ship in no package"


def test_no_function_or_class_of_package_code_is_longer_than_the_limit() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_lines(node)} lines)"
        for path, tree in _trees()
        for node in ast.walk(tree)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > MAX_FUNCTION_LINES)
        or (isinstance(node, ast.ClassDef) and _lines(node) > MAX_CLASS_LINES)
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines or classes over {MAX_CLASS_LINES}: {long}"


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's parameters, ``self`` and ``cls`` left out; ``*args`` and ``**kwargs`` count one each."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
    return names + [a.arg for a in (args.vararg, args.kwarg) if a is not None]


def test_no_function_of_package_code_takes_more_than_the_limit() -> None:
    wide = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({len(_parameters(node))} parameters)"
        for path, tree in _trees()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and len(_parameters(node)) > MAX_PARAMETERS
    ]
    assert not wide, f"functions of more than {MAX_PARAMETERS} parameters: {wide}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(self, a, b, *, c): ...", 3),
        ("def f(cls, /, a, *args, **kwargs): ...", 3),
        ("def f(): ...", 0),
    ],
)
def test_the_parameter_count_leaves_out_self_and_counts_the_rest(source: str, expected: int) -> None:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    assert len(_parameters(node)) == expected


def _own_private_names(tree: ast.Module) -> set[str]:
    """Private names the module's own classes and functions define: attributes, slots, members."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)  # self._x = ..., obj._x = ...
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names |= {
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _private_reads(path: Path, tree: ast.Module) -> list[str]:
    own = _own_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        base = ast.unparse(node.value)
        if base in ("self", "cls") or base.split(".")[0] == "torch" or node.attr in own:
            continue
        if (path.name, node.attr) in TORCH_PRIVATE:
            continue
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_state() -> None:
    reads = [read for path, tree in _trees([*SOURCES, *EXAMPLES]) for read in _private_reads(path, tree)]
    assert not reads, reads


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("class A:\n    __slots__ = ('_x',)\ndef f(a: A) -> int:\n    return a._x\n", 0),
        ("def f(buffers: object) -> object:\n    return buffers._bounds\n", 1),
        ("import torch\nx = torch._C._foo\n", 0),
        ("def f(self: object) -> object:\n    return self._y\n", 0),
    ],
)
def test_the_private_read_check_tells_own_state_from_anothers(source: str, expected: int) -> None:
    path = ROOT / "packages/example.py"
    assert len(_private_reads(path, ast.parse(source))) == expected


#: Private names package code imports from another package or module, with why no public one serves.
PRIVATE_IMPORTS_ALLOWED: Final[dict[tuple[str, str], str]] = {}


def _private_imports(path: Path, tree: ast.Module) -> list[str]:
    """``from x import _name`` of a private name, and ``getattr(obj, "_name")`` of one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[
                0
            ] == "torch":  # torch's private API, where no public one exists
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and (path.name, alias.name) not in PRIVATE_IMPORTS_ALLOWED:
                    found.append(
                        f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}"
                    )
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and ast.unparse(node.args[0]).split(".")[0] != "torch"
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_imports_or_getattrs_a_private_name() -> None:
    found = [hit for path, tree in _trees([*SOURCES, *EXAMPLES]) for hit in _private_imports(path, tree)]
    assert not found, found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from .reference import _rotate\n", 1),
        ("from .reference import rotate\n", 0),
        ("getattr(model, '_orig_mod')\n", 1),
        ("getattr(model, 'graph_support', None)\n", 0),
        ("getattr(model, '__self__', None)\n", 0),
        ("from torch.utils import _pytree\n", 0),
        ("getattr(torch._C, '_cuda_x', None)\n", 0),
    ],
)
def test_the_private_import_check_finds_them(source: str, expected: int) -> None:
    path = ROOT / "packages/example.py"
    assert len(_private_imports(path, ast.parse(source))) == expected


#: A planned graph's state that only the graph table's module writes (``PlannedGraph.keep``, ``replayed``,
#: ``replayed_steps``, ``drop``, ``GraphTable.reset_replays``); the table's ``loops`` likewise
#: (``GraphTable.keep_loop``).
PLANNED_GRAPH_STATE: Final = frozenset({"entry", "replays", "last_cut"})


def test_a_planned_graphs_state_is_written_only_by_the_graph_table() -> None:
    planned = ROOT / "packages/manager/src/cudagraph_manager/_graphs/_table.py"
    writes = [
        f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(target)}"
        for path, tree in _trees()
        if path != planned
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for written in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for target in ast.walk(written)
        if (isinstance(target, ast.Attribute) and target.attr in PLANNED_GRAPH_STATE)
        or (  # the table's loops: ``table.loops[key] = loop``
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Attribute)
            and target.value.attr == "loops"
        )
    ]
    assert not writes, f"a PlannedGraph's state written outside _graphs/_table.py: {writes}"
