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
    """The packages' and tests' Python files, this one (which names the pattern) left out."""
    found = {*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("tests/**/*.py")}
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
