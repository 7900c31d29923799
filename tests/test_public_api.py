"""The public API in tiers: a small top level per package, the rest in named tiers, one home per name.

Like trio (``trio``, ``trio.lowlevel``, ``trio.testing``): what most users
import is the packages' top level; the seams and helpers of engines built on
them live in the tiers below. No count of names is pinned: each public name
has a reason, written beside it in its package README's table of public
names, and the surface is reviewed, not budgeted by a test.

A name retired from the API keeps resolving, silently, from the module it was
public in, to the same object, for the code that imports it this release:
each tier lists its retired names in one mapping (``_RETIRED``), and its
README lists each with what to use instead.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parents[1]
#: Each package's public modules: its top level, then its tiers.
PUBLIC: Final = {
    "cudagraph_dispatch": (
        "cudagraph_dispatch",
        "cudagraph_dispatch.support",
        "cudagraph_dispatch.lowlevel",
        "cudagraph_dispatch.budgets",
    ),
    "cudagraph_capture": ("cudagraph_capture", "cudagraph_capture.lowlevel"),
    "cudagraph_manager": (
        "cudagraph_manager",
        "cudagraph_manager.attention",
        "cudagraph_manager.ranks",
        "cudagraph_manager.lowlevel",
    ),
}
MODULES: Final = [module for modules in PUBLIC.values() for module in modules]

#: Every name retired from the API this release: (the module it was public in, its name) -> where the
#: object lives now (module, name). Written here on its own, so a mapping that drifts fails.
RETIRED: Final = {
    ("cudagraph_dispatch", "GraphDispatcher"): ("cudagraph_dispatch._protocols", "GraphDispatcher"),
    ("cudagraph_dispatch", "Route"): ("cudagraph_dispatch._rule", "Route"),
    ("cudagraph_dispatch", "StepRequest"): ("cudagraph_dispatch._request", "RankRequest"),
    ("cudagraph_dispatch.support", "ModeNotSupportedError"): (
        "cudagraph_dispatch._support",
        "ModeNotSupportedError",
    ),
    ("cudagraph_dispatch.support", "ModeResolution"): ("cudagraph_dispatch._support", "ModeResolution"),
    ("cudagraph_dispatch.support", "resolve_mode"): ("cudagraph_dispatch._support", "resolve_mode"),
    ("cudagraph_dispatch.lowlevel", "FORWARD_CONTEXT_VAR"): (
        "cudagraph_dispatch._context",
        "FORWARD_CONTEXT_VAR",
    ),
    ("cudagraph_dispatch.lowlevel", "MAX_CAPTURE_SIZE"): ("cudagraph_dispatch._sizes", "MAX_CAPTURE_SIZE"),
    ("cudagraph_dispatch.lowlevel", "MAX_NUM_SEQS"): ("cudagraph_dispatch._config", "MAX_NUM_SEQS"),
    ("cudagraph_dispatch.lowlevel", "NO_MODES"): ("cudagraph_dispatch._request", "NO_MODES"),
    ("cudagraph_capture", "shared_pool"): ("cudagraph_capture._pool", "shared_pool"),
    ("cudagraph_capture.lowlevel", "GraphPool"): ("cudagraph_capture._pool", "GraphPool"),
    ("cudagraph_capture.lowlevel", "LoopFallback"): ("cudagraph_capture._conditional", "LoopFallback"),
    ("cudagraph_capture.lowlevel", "OutputGuard"): ("cudagraph_capture._guard", "OutputGuard"),
    ("cudagraph_capture.lowlevel", "SwitchReplay"): ("cudagraph_capture._choice", "SwitchReplay"),
    ("cudagraph_capture.lowlevel", "capture_disabled_reason"): (
        "cudagraph_capture._enabled",
        "capture_disabled_reason",
    ),
    ("cudagraph_capture.lowlevel", "capture_lock"): ("cudagraph_capture._pool", "capture_lock"),
    ("cudagraph_capture.lowlevel", "capture_stream"): ("cudagraph_capture._pool", "capture_stream"),
    ("cudagraph_capture.lowlevel", "check_capture_enabled"): (
        "cudagraph_capture._enabled",
        "check_capture_enabled",
    ),
    ("cudagraph_capture.lowlevel", "collector_paused"): ("cudagraph_capture._gc", "collector_paused"),
    ("cudagraph_capture.lowlevel", "drop_cublas_workspaces"): (
        "cudagraph_capture._cublas",
        "drop_cublas_workspaces",
    ),
    ("cudagraph_capture.lowlevel", "loop_fallback_counts"): (
        "cudagraph_capture._loop",
        "loop_fallback_counts",
    ),
    ("cudagraph_capture.lowlevel", "weak_ref_tensors"): ("cudagraph_capture._weakref", "weak_ref_tensors"),
    ("cudagraph_manager", "CapturePhases"): ("cudagraph_manager._values._reports", "CapturePhases"),
    ("cudagraph_manager", "CapturedGraph"): ("cudagraph_manager._values._reports", "CapturedGraph"),
    ("cudagraph_manager", "KVCacheBacking"): ("cudagraph_manager._values._reports", "KVCacheBacking"),
    ("cudagraph_manager", "LoopResult"): ("cudagraph_manager._values._loop", "LoopResult"),
    ("cudagraph_manager", "ManagerStats"): ("cudagraph_manager._values._reports", "ManagerStats"),
    ("cudagraph_manager", "OutputRows"): ("cudagraph_manager._memory._outputs", "OutputRows"),
    ("cudagraph_manager", "Rows"): ("cudagraph_manager._values._inputs", "Rows"),
    ("cudagraph_manager.attention", "KindCheck"): ("cudagraph_manager._support_check", "KindCheck"),
    ("cudagraph_manager.attention", "SupportCheck"): ("cudagraph_manager._support_check", "SupportCheck"),
    ("cudagraph_manager.ranks", "Backend"): ("cudagraph_manager.ranks._agreement", "Backend"),
    ("cudagraph_manager.lowlevel", "ModelOutput"): ("cudagraph_manager._values._protocols", "ModelOutput"),
}

#: A README's table of public names (one row per name), and its table of the names retired from the API.
_PUBLIC_HEADER: Final = "| name | module | why it is public |"
_RETIRED_HEADER: Final = "| retired name | was public in | use instead |"


def _readme(package: str) -> str:
    return (ROOT / "packages" / package.removeprefix("cudagraph_") / "README.md").read_text()


def _table(readme: str, header: str) -> list[tuple[str, str, str]]:
    """The rows of the README's table under ``header``: (name, module, the third cell), backticks dropped."""
    lines = readme.splitlines()
    assert lines.count(header) == 1, f"expected one table headed {header!r}"
    rows = []
    for line in lines[lines.index(header) + 2 :]:
        if not line.startswith("|"):
            break
        name, module, third = (cell.strip() for cell in line.strip("|").split("|", 2))
        assert name.startswith("`"), line
        assert module.startswith("`"), line
        assert third, f"{line}: the third cell says nothing"
        rows.append((re.sub(r"[`(].*", "", name.strip("`")), module.strip("`"), third))
    return rows


def _without_tables(readme: str) -> str:
    """The README's text without its two tables (where every public name is described besides)."""
    kept, skipping = [], False
    for line in readme.splitlines():
        if line in (_PUBLIC_HEADER, _RETIRED_HEADER):
            skipping = True
        elif skipping and not line.startswith("|"):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


def _names(module: str) -> list[str]:
    names: list[str] = _module(module).__all__
    return names


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_public_name_has_one_home(package: str) -> None:
    """A name is public in one module of its package: no tier repeats another's (or the top level's)."""
    homes: dict[str, list[str]] = {}
    for module in PUBLIC[package]:
        for name in _names(module):
            homes.setdefault(name, []).append(module)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}


@pytest.mark.parametrize("module", MODULES)
def test_all_dir_and_the_readmes_table_agree(module: str) -> None:
    """``__all__``, the public names ``dir()`` lists (modules aside) and the README's rows are one set.

    Each README row gives the name a reason to be public (one clause); every
    name of ``__all__`` exists, and is documented in the README's text too.
    """
    loaded = _module(module)
    public = sorted(loaded.__all__)
    listed = sorted(
        name
        for name in dir(loaded)
        if not name.startswith("_") and not isinstance(getattr(loaded, name), ModuleType)
    )
    assert listed == public, f"{module}: dir() lists {listed}"
    assert [name for name in public if not hasattr(loaded, name)] == []
    readme = _readme(module.split(".")[0])
    rows = sorted(name for name, where, _ in _table(readme, _PUBLIC_HEADER) if where == module)
    assert rows == public, f"{module}: the README's table of public names lists {rows}"
    text = _without_tables(readme)
    undocumented = [name for name in public if not re.search(rf"`{name}[`(\[ .]", text)]
    assert undocumented == [], f"{module}: described nowhere but in the table: {undocumented}"


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_the_readmes_tables_name_modules_of_their_package(package: str) -> None:
    readme = _readme(package)
    for header in (_PUBLIC_HEADER, _RETIRED_HEADER):
        assert {where for _, where, _ in _table(readme, header)} <= set(PUBLIC[package]), header


@pytest.mark.parametrize("module", MODULES)
def test_retired_names_are_listed_once_per_tier_and_in_the_readme(module: str) -> None:
    """The tier's mapping, this test's list and the README's retired table name the same names."""
    retired = getattr(_module(module), "_RETIRED", {})
    expected = {name for (where, name) in RETIRED if where == module}
    assert set(retired) == expected
    assert {name: tuple(home) for name, home in retired.items()} == {
        name: RETIRED[module, name] for name in expected
    }
    table = _table(_readme(module.split(".")[0]), _RETIRED_HEADER)
    rows = [name for name, where, _ in table if where == module]
    assert sorted(rows) == sorted(expected), f"{module}: the README's retired table lists {rows}"


@pytest.mark.parametrize(("module", "name"), sorted(RETIRED))
def test_a_retired_name_resolves_silently_to_the_same_object(module: str, name: str) -> None:
    """From where it was public: the object it named, silently; in neither ``__all__`` nor ``dir()``."""
    home, attribute = RETIRED[module, name]
    loaded = _module(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = getattr(loaded, name)
        namespace: dict[str, object] = {}
        exec(f"from {module} import {name}", namespace)
    assert caught == []
    assert resolved is getattr(_module(home), attribute)
    assert namespace[name] is resolved
    assert name not in loaded.__all__
    assert name not in dir(loaded)


@pytest.mark.parametrize("module", MODULES)
def test_an_unknown_name_is_still_an_attribute_error(module: str) -> None:
    loaded = _module(module)
    with pytest.raises(
        AttributeError, match=rf"module '{re.escape(module)}' has no attribute 'no_such_name'"
    ):
        loaded.no_such_name  # noqa: B018 - the attribute access is the test


@pytest.mark.parametrize("module", [m for m in MODULES if getattr(_module(m), "_RETIRED", None)])
def test_the_typing_block_names_the_retired_names(module: str) -> None:
    """What mypy sees under ``TYPE_CHECKING`` (the retired names, typed) is the mapping's names."""
    path = Path(_module(module).__file__ or "")
    tree = ast.parse(path.read_text())
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1
    typed: set[str] = set()
    for node in blocks[0].body:
        if isinstance(node, ast.ImportFrom):
            typed |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Assign):
            typed |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    assert typed == set(_module(module)._RETIRED)


_LAZY_PROBE: Final = """
import importlib, json, sys
dispatch = [key for key in {retired!r} if key[0].startswith("cudagraph_dispatch")]
for module, name in dispatch:
    getattr(importlib.import_module(module), name)
torch_after_dispatch = "torch" in sys.modules
for module, name in {retired!r}:
    getattr(importlib.import_module(module), name)
import torch
print(json.dumps([torch_after_dispatch, torch.cuda.is_initialized()]))
"""


def test_resolving_the_retired_names_stays_lean() -> None:
    """In a fresh interpreter: the dispatch package's retired names load no torch, none initializes CUDA."""
    done = subprocess.run(
        [sys.executable, "-c", _LAZY_PROBE.format(retired=sorted(RETIRED))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "[false, false]"


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("cudagraph_manager", "attention_metadata"),
        ("cudagraph_manager", "check_attention_support"),
        ("cudagraph_manager", "RankAgreement"),
        ("cudagraph_manager", "EagerReason"),
        ("cudagraph_capture", "release_graph_memory"),
        ("cudagraph_capture", "ReservedMemory"),
        ("cudagraph_dispatch", "check_int"),
        ("cudagraph_dispatch", "AttentionSupport"),
    ],
)
def test_a_tiers_name_is_not_at_the_top_level(module: str, name: str) -> None:
    """The seams and the low-level helpers left the top level for their tiers (not even unlisted)."""
    assert not hasattr(importlib.import_module(module), name)


def test_our_own_code_imports_no_retired_name_through_a_tier() -> None:
    """The packages, examples and tests import a retired name from its home, never through a tier.

    A retired name still resolves for outside code this release; ours must not lean on it.
    """
    retired = {
        module: set(getattr(_module(module), "_RETIRED", {}))
        for modules in PUBLIC.values()
        for module in modules
    }
    sources = [
        *ROOT.glob("packages/*/src/**/*.py"),
        *(ROOT / "examples").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
    ]
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}"
        for path in sources
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in retired
        for alias in node.names
        if alias.name in retired[node.module]
    ]
    assert not found, found
