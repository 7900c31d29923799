"""The READMEs' complete Python examples run as written (GPU): users copy them.

Covered elsewhere: the dispatch README (``tests/dispatch/test_readme.py``,
on the CPU), the top-level "In an engine" and "Compiled models" blocks (they
are the example files, run by ``tests/manager``), the manager README's
compiled block (``tests/manager/test_compiled.py``). Here: the capture
README's three blocks, one program read top to bottom, and the manager
README's first example. The other blocks are excerpts of a serving loop or of
a multi-GPU program, and say so where they stand.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parents[1]


def python_blocks(readme: Path) -> list[str]:
    """The README's Python code blocks, dedented (a block inside a list item is indented)."""
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", readme.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [textwrap.dedent(code) for _, code in blocks]


def _run(code: str, where: str) -> None:
    exec(compile(code, where, "exec"), {"__name__": "readme_example"})


@pytest.mark.gpu
def test_the_capture_readme_runs_top_to_bottom() -> None:
    blocks = python_blocks(ROOT / "packages/capture/README.md")
    assert len(blocks) == 3
    _run("\n".join(blocks), "packages/capture/README.md")


def test_the_manager_readmes_first_example_runs() -> None:
    """On a GPU it captures and replays; on a CPU (the newcomer's 5: it crashed there) it runs eagerly."""
    first = python_blocks(ROOT / "packages/manager/README.md")[0]
    assert "manager.run(input_ids=ids)" in first
    _run(first, "packages/manager/README.md")
