"""The package README's example runs as written: it is the wheel's description, and users copy it."""

from __future__ import annotations

import re
from pathlib import Path

import cudagraph_dispatch
from cudagraph_dispatch import EagerReason

README = Path(__file__).resolve().parents[2] / "packages" / "dispatch" / "README.md"


def test_readme_example_runs() -> None:
    """The README's Python block executes without error (its asserts check the decisions it shows)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert len(blocks) == 1, "expected exactly one example"
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme_example"})


def test_readme_names_every_eager_reason() -> None:
    """Each ``EagerReason`` is a key of a runner's eager counts: the README names every one (issue 33)."""
    text = README.read_text(encoding="utf-8")
    missing = [reason.name for reason in EagerReason if f"`{reason.name}`" not in text]
    assert missing == []


def test_readme_names_every_public_name() -> None:
    """Every name of ``__all__`` is documented (``MAX_NUM_SEQS`` included)."""
    text = README.read_text(encoding="utf-8")
    missing = [name for name in cudagraph_dispatch.__all__ if f"`{name}" not in text]
    assert missing == []
