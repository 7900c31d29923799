"""The package README's example runs as written: it is the wheel's description, and users copy it."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "packages" / "dispatch" / "README.md"


def test_readme_example_runs() -> None:
    """The README's Python block executes without error (its asserts check the decisions it shows)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert len(blocks) == 1, "expected exactly one example"
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme_example"})
