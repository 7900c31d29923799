"""``examples/README.md`` maps every example module, and the tests it names exist.

The map says what each folder and module is for, how to run the runnable
ones and which tests exercise each; a module added without a row, or a test
renamed under the map, fails here. The top-level README links the map.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
MAP: Final = ROOT / "examples" / "README.md"


def _modules() -> list[str]:
    """Every module of ``examples/``, dotted (a package by its own name)."""
    found = []
    for path in sorted((ROOT / "examples").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append(".".join(parts))
    return found


def _rows() -> list[list[str]]:
    """The cells of every table row of the map (header and rule lines left out)."""
    rows = []
    for line in MAP.read_text().splitlines():
        if line.startswith("| `"):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
    return rows


def test_every_example_module_has_one_row() -> None:
    named = Counter(row[0].strip("`") for row in _rows())
    assert sorted(named) == _modules()
    assert [name for name, count in named.items() if count > 1] == []


def test_every_test_the_map_names_exists() -> None:
    cited = {path for row in _rows() for path in re.findall(r"`([\w/]+\.py)`", row[-1])}
    assert cited
    assert sorted(path for path in cited if not (ROOT / "tests" / path).is_file()) == []


def test_the_runnable_examples_say_how_to_run_them() -> None:
    """A row of the runnable table says the command (``python -m`` the module itself)."""
    text = MAP.read_text()
    runnable = text.split("## Runnable examples", 1)[1].split("\n## ", 1)[0]
    for row in (r for r in _rows() if f"| {r[0]} |" in runnable):
        assert f"python -m {row[0].strip('`')}" in row[2], row[0]


def test_the_top_level_readme_links_the_map() -> None:
    assert "(examples/README.md)" in (ROOT / "README.md").read_text()
