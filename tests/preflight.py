"""What a `make` target that uses an existing python needs of it, checked before the target starts.

``python -m tests.preflight TARGET`` exits 0 when ``sys.executable`` can
import every module ``TARGET`` needs, else 2 with one message naming the
python, the missing modules and the way out: ``make gpu-test PYTHON=python3``
on an image without pytest failed with an import error for each test module
before (issue 39). Looks modules up only (``importlib.util.find_spec``):
nothing is imported, so the check takes milliseconds and initializes no CUDA.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping, Sequence
from typing import Final

#: The modules each target imports, by their import names.
NEEDS: Final[Mapping[str, tuple[str, ...]]] = {
    "gpu-test": ("torch", "pytest", "hypothesis", "pytest_benchmark"),
    "gpu-bench": ("torch", "pytest", "pytest_benchmark"),
    "soak": ("torch",),
}
#: The distribution each import name comes from, where the two differ.
_DISTRIBUTIONS: Final[Mapping[str, str]] = {"pytest_benchmark": "pytest-benchmark"}


def missing(modules: Sequence[str]) -> list[str]:
    """The modules of ``modules`` this python cannot import, in order."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """0 when this python has what the target needs; else 2, naming what is missing."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1 or args[0] not in NEEDS:
        print(f"usage: python -m tests.preflight {{{','.join(NEEDS)}}}", file=sys.stderr)
        return 2
    target = args[0]
    gone = missing(NEEDS[target])
    if not gone:
        return 0
    names = ", ".join(_DISTRIBUTIONS.get(name, name) for name in gone)
    print(
        f"make {target}: {sys.executable} cannot import {names}, which `make {target}` needs "
        f"(it installs nothing). Install {'it' if len(gone) == 1 else 'them'} into that python "
        "(the dev group of pyproject.toml pins the versions), or pass PYTHON=a python that has "
        f"{'it' if len(gone) == 1 else 'them'}; `make test` and `make bench` use the dev venv instead.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
