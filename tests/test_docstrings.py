"""The public callables of dispatch and capture document their arguments, returns and errors.

Google style: a public function, method or class (its constructor) that
takes arguments names each under ``Args:``; one that takes arguments or
raises says what it returns under ``Returns:`` (a one-line docstring of an
accessor without arguments says it in its summary); one that raises says
what under ``Raises:``. A ``NamedTuple`` or dataclass names its fields
under ``Args:`` or ``Attributes:``; an enum and an exception class need
none. Torch's own "Arguments:" style is not used. The manager's
docstrings are held to the same rule once its modules settle.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from tests.test_public_api import PUBLIC

#: Constructors not meant to be called: the classmethods build the object.
_NOT_CALLED: Final = frozenset({("DeviceLoop", "__init__")})
_SECTION: Final = re.compile(r"^\s*(Args|Arguments|Attributes|Returns|Yields|Raises):\s*$", re.MULTILINE)


def _sections(node: ast.FunctionDef | ast.ClassDef) -> tuple[str, set[str]]:
    doc = ast.get_docstring(node) or ""
    return doc, set(_SECTION.findall(doc))


def _parameters(node: ast.FunctionDef) -> list[str]:
    arguments = node.args
    names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    names += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    return [name for name in names if name not in ("self", "cls")]


def _gaps(where: str, node: ast.FunctionDef, class_doc: str = "") -> Iterator[str]:
    """What the docstring of ``node`` lacks (a constructor's may be its class's)."""
    doc, sections = _sections(node)
    if node.name == "__init__" and "Args" not in sections:
        doc, sections = class_doc, set(_SECTION.findall(class_doc))
    parameters = _parameters(node)
    raises = any(isinstance(n, ast.Raise) for n in ast.walk(node))
    returns = node.returns is not None and ast.unparse(node.returns) != "None"
    is_property = any("property" in ast.unparse(d) for d in node.decorator_list)
    if "Arguments" in sections:
        yield f"{where}: 'Arguments:' (use 'Args:')"
    if parameters:
        if "Args" not in sections:
            yield f"{where}: no 'Args:'"
        else:
            missing = [p for p in parameters if not re.search(rf"^\s+\**{p}\b", doc, re.MULTILINE)]
            if missing:
                yield f"{where}: 'Args:' misses {missing}"
    if raises and "Raises" not in sections:
        yield f"{where}: no 'Raises:'"
    sectioned = bool(parameters) or raises
    if sectioned and returns and not is_property and node.name != "__init__" and "Returns" not in sections:
        yield f"{where}: no 'Returns:'"


def _class_node(cls: type) -> ast.ClassDef:
    tree = ast.parse(Path(inspect.getsourcefile(cls) or "").read_text())
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    return node


def _class_gaps(where: str, cls: type) -> Iterator[str]:
    node = _class_node(cls)
    _, sections = _sections(node)
    if "Arguments" in sections:
        yield f"{where}: 'Arguments:' (use 'Args:')"
    fields = [
        n.target.id
        for n in node.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and not n.target.id.startswith("_")
    ]
    plain = issubclass(cls, (BaseException, enum.Enum))
    defines_init = any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in node.body)
    if fields and not plain and not defines_init and not sections & {"Args", "Attributes"}:
        yield f"{where}: fields without 'Args:' or 'Attributes:'"
    for klass in cls.__mro__:
        if not klass.__module__.startswith(("cudagraph_dispatch", "cudagraph_capture")):
            continue
        klass_node = _class_node(klass)
        klass_doc = ast.get_docstring(klass_node) or ""
        for method in klass_node.body:
            if not isinstance(method, ast.FunctionDef) or (klass.__name__, method.name) in _NOT_CALLED:
                continue
            if method.name.startswith("_") and method.name not in ("__init__", "__call__"):
                continue
            if method.name == "__init__" and klass is not cls:  # a base's: the class's own is public
                continue
            yield from _gaps(f"{where}.{method.name}", method, klass_doc)


def _public_callables() -> list[str]:
    found = []
    for package in ("cudagraph_dispatch", "cudagraph_capture"):
        for module in PUBLIC[package]:
            found += [f"{module}:{name}" for name in importlib.import_module(module).__all__]
    return found


@pytest.mark.parametrize("qualified", _public_callables())
def test_a_public_callable_documents_its_arguments_returns_and_errors(qualified: str) -> None:
    module, name = qualified.split(":")
    obj = getattr(importlib.import_module(module), name)
    if isinstance(obj, type):
        gaps = list(_class_gaps(name, obj))
    elif inspect.isfunction(obj):
        tree = ast.parse(Path(inspect.getsourcefile(obj) or "").read_text())
        (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == obj.__name__]
        gaps = list(_gaps(name, node))
    else:  # a constant: nothing to call
        gaps = []
    assert gaps == []


def test_the_check_finds_what_a_docstring_lacks() -> None:
    source = '''
def f(x: int, *, y: int = 0) -> int:
    """Does things.

    Args:
        x: a thing.
    """
    if x < 0:
        raise ValueError("x")
    return x
'''
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.FunctionDef)
    assert list(_gaps("f", node)) == ["f: 'Args:' misses ['y']", "f: no 'Raises:'", "f: no 'Returns:'"]
