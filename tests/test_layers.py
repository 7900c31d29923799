"""Each package's modules in one declared order: no import cycle, no import up the order.

``LAYERS`` lists each package's layers bottom to top (docs/design.md,
"Layers"); a module imports only from its own layer or those below it, and
the imports of one layer form no cycle. Every import counts: at the top,
inside functions, and under ``TYPE_CHECKING``. A module no layer names fails
too, so a new module takes its place in the order on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parents[1]

#: Bottom to top: each entry a layer, each layer module names or folders (relative to the package).
LAYERS: Final[dict[str, tuple[tuple[str, ...], ...]]] = {
    "cudagraph_dispatch": (
        ("_checks", "_modes", "_reasons", "_retired"),
        ("_sizes", "_descriptor", "_request"),
        ("_config",),
        ("_budgets", "_support"),
        ("_context",),
        ("_rule",),
        ("_dispatcher",),
        ("_protocols",),
        ("_ranks",),
        ("lowlevel", "support", "budgets", "__init__"),
    ),
    "cudagraph_capture": (
        (
            "_errors",
            "_device",
            "_cublas",
            "_gc",
            "_weakref",
            "_kernels",
            "_conditional",
            "_reserved",
            "_protocols",
        ),
        ("_enabled", "_pool", "_guard"),
        ("_options", "_segment"),
        ("_breakable", "_loop"),
        ("_recorder",),
        ("_wrapper", "_choice"),
        ("lowlevel", "__init__"),
    ),
    "cudagraph_manager": (
        ("_values", "_attention", "_compiled", "ranks"),  # values, and beside them what needs only values
        ("_memory",),  # buffers, outputs, the device, weights, the KV cache
        ("_options", "_parts"),  # the options, checked into a manager's parts
        ("_graphs",),  # the graph table and the captures
        ("_steps",),  # the step plan, the replay, eager steps, run_loop
        ("_manager",),  # the facade
        ("_support_check",),  # a tool on the facade
        ("attention", "lowlevel", "__init__"),  # the public tiers
    ),
}
#: The packages each package may import (besides itself): the design's layering.
BELOW: Final = {
    "cudagraph_dispatch": frozenset[str](),
    "cudagraph_capture": frozenset({"cudagraph_dispatch"}),
    "cudagraph_manager": frozenset({"cudagraph_dispatch", "cudagraph_capture"}),
}


def _source_root(package: str) -> Path:
    return ROOT / "packages" / package.removeprefix("cudagraph_") / "src"


def _modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its own name)."""
    root = _source_root(package)
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path) -> Iterator[str]:
    """The absolute names every import statement of the module names (relative ones resolved)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)  # `from . import x`


def _internal_edges(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = _modules(package)
    return {
        name: {target for target in _imports(name, path) if target in modules and target != name}
        for name, path in modules.items()
    }


def _layer(package: str, module: str) -> int | None:
    rest = module.removeprefix(package).lstrip(".") or "__init__"
    first = rest.split(".")[0]
    for index, layer in enumerate(LAYERS[package]):
        if first in layer:
            return index
    return None


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_every_module_has_a_layer(package: str) -> None:
    unplaced = [name for name in _modules(package) if _layer(package, name) is None]
    assert not unplaced, f"modules in no layer of LAYERS[{package!r}]: {unplaced}"


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_import_goes_up_the_order(package: str) -> None:
    upward = [
        f"{name} (layer {_layer(package, name)}) imports {target} (layer {_layer(package, target)})"
        for name, targets in _internal_edges(package).items()
        for target in sorted(targets)
        if (_layer(package, target) or 0) > (_layer(package, name) or 0)
    ]
    assert not upward, upward


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_import_cycle(package: str) -> None:
    assert not _cycles(_internal_edges(package))


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_a_package_imports_none_above_it(package: str) -> None:
    """Nor the repository's examples and tests, which ship in no wheel."""
    above = (set(LAYERS) - BELOW[package] - {package}) | {"examples", "tests"}
    found = sorted(
        f"{name} imports {target}"
        for name, path in _modules(package).items()
        for target in _imports(name, path)
        if target.split(".")[0] in above
    )
    assert not found, found
