"""docs/design.md is the repository's design document: the rules the tests cite are in it.

A citation is ``docs/design.md`` followed, within the same sentence, by a
section name in quotes; each cited name must be a heading of the document, so
a renamed section fails here rather than leaving a test pointing nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
DESIGN: Final = ROOT / "docs" / "design.md"
_CITATION: Final = re.compile(r'docs/design\.md[^"\n]{0,12}"([^"]+)"|docs/design\.md \("([^"]+)"\)')


def _sources() -> list[Path]:
    """The packages', examples' and tests' Python files, this one (which names the pattern) left out."""
    found = {
        *ROOT.glob("packages/*/src/**/*.py"),
        *ROOT.glob("examples/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
    }
    return sorted(found - {Path(__file__).resolve()})


def test_every_cited_section_is_a_heading_of_the_design_document() -> None:
    headings = set(re.findall(r"^#+ (.+)$", DESIGN.read_text(), flags=re.MULTILINE))
    cited: dict[str, list[str]] = {}
    for path in _sources():
        text = path.read_text()
        for match in _CITATION.finditer(text):
            name = match.group(1) or match.group(2)
            cited.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert cited, "nothing cites docs/design.md"
    missing = {name: where for name, where in cited.items() if name not in headings}
    assert not missing, f"sections cited but not in docs/design.md: {missing}"


def test_no_source_cites_the_design_outside_the_repository() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in _sources() if "DESIGN.md" in p.read_text()]
    assert not offenders


def test_the_map_names_every_module_of_the_manager_in_its_folder() -> None:
    """docs/design.md ("Layers") maps the manager's folders: a module added or moved is added there."""
    text = DESIGN.read_text()
    start = text.index("cudagraph_manager/\n")
    tree = text[start : text.index("```", start)]
    named: set[str] = set()
    folder = ""
    for line in tree.splitlines()[1:]:
        name = line.split()[0] if line.strip() else ""
        if name.endswith("/"):
            folder = name
            named.add(folder)
        elif name.endswith(".py"):
            named.add(f"{folder}{name}" if line.startswith("    ") else name)
    package = ROOT / "packages/manager/src/cudagraph_manager"
    modules = {
        "/".join(p.relative_to(package).parts)
        for p in package.glob("*/*.py")
        if p.parent.name != "ranks" and p.name != "__init__.py"
    }
    modules |= {p.name for p in package.glob("*.py")}
    # A folder is a module folder where it holds modules (a stale one of caches alone is not).
    modules |= {f"{p.name}/" for p in package.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert modules - named == set(), "modules missing from the map"
    assert named - modules == set(), "the map names modules that do not exist"
