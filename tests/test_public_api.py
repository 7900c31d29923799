"""The public API in tiers: a small top level per package, the rest in named tiers, one home per name.

Like trio (``trio``, ``trio.lowlevel``, ``trio.testing``): what most users
import is the packages' top level; the seams and helpers of engines built on
them live in the tiers below. No count of names is pinned: each public name
has a reason, and the surface is reviewed, not budgeted by a test. Every
public name is documented in its package's README.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
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


def _names(module: str) -> list[str]:
    names: list[str] = importlib.import_module(module).__all__
    return names


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_public_name_has_one_home(package: str) -> None:
    """A name is public in one module of its package: no tier repeats another's (or the top level's)."""
    homes: dict[str, list[str]] = {}
    for module in PUBLIC[package]:
        for name in _names(module):
            homes.setdefault(name, []).append(module)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}


@pytest.mark.parametrize("module", [m for modules in PUBLIC.values() for m in modules])
def test_every_name_of_all_exists_and_is_documented(module: str) -> None:
    loaded = importlib.import_module(module)
    assert loaded.__all__, module
    missing = [name for name in loaded.__all__ if not hasattr(loaded, name)]
    assert not missing, f"{module}.__all__ names what it lacks: {missing}"
    package = module.split(".")[0]
    readme = (ROOT / "packages" / package.removeprefix("cudagraph_") / "README.md").read_text()
    undocumented = [name for name in loaded.__all__ if not re.search(rf"`{name}[`(\[ ]", readme)]
    assert not undocumented, f"{module}: not in the package README: {undocumented}"


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("cudagraph_manager", "attention_metadata"),
        ("cudagraph_manager", "check_attention_support"),
        ("cudagraph_manager", "RankAgreement"),
        ("cudagraph_manager", "EagerReason"),
        ("cudagraph_capture", "capture_lock"),
        ("cudagraph_capture", "GraphPool"),
        ("cudagraph_dispatch", "check_int"),
        ("cudagraph_dispatch", "AttentionSupport"),
    ],
)
def test_a_tiers_name_is_not_at_the_top_level(module: str, name: str) -> None:
    """The seams and the low-level helpers left the top level for their tiers (not even unlisted)."""
    assert not hasattr(importlib.import_module(module), name)
