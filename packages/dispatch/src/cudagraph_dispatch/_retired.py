"""Names retired from a public tier: still resolved, lazily and silently, for the code that imports them.

Each tier keeps one mapping, ``_RETIRED``: a retired name to its home
(module, attribute). ``resolver(tier, retired)`` is the tier's module
``__getattr__`` (PEP 562): a retired name is imported from its home when
first asked for (so a tier stays as lean to import as before), any other
raises ``AttributeError``. Each package's README lists them under "Names
retired from the API"; the siblings import this module (they are released
together).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def resolver(tier: str, retired: Mapping[str, tuple[str, str]]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``tier``: a name of ``retired`` from its home, else AttributeError."""

    def resolve(name: str) -> object:
        if name not in retired:
            raise AttributeError(f"module {tier!r} has no attribute {name!r}")
        module, attribute = retired[name]
        return getattr(importlib.import_module(module), attribute)

    return resolve
