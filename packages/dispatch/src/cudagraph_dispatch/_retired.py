"""Names retired from a public tier: still resolved, lazily and silently, for the code that imports them.

Each tier keeps one mapping, ``_RETIRED``: a retired name to its home
(module, attribute). ``resolver(tier, public, retired)`` makes the tier's
module ``__getattr__`` and ``__dir__`` (PEP 562): a retired name is imported
from its home when first asked for (so a tier stays as lean to import as
before), any other raises ``AttributeError``; ``dir()`` lists the public
names (``__all__``) alone. Each package's README lists them under "Names
retired from the API"; the siblings import this module (they are released
together).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence


def resolver(
    tier: str, public: Sequence[str], retired: Mapping[str, tuple[str, str]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``tier``.

    ``__getattr__``: a name of ``retired`` from its home, else
    ``AttributeError``. ``__dir__``: the ``public`` names, sorted (a retired
    name resolves, but is not listed).
    """

    def resolve(name: str) -> object:
        if name not in retired:
            raise AttributeError(f"module {tier!r} has no attribute {name!r}")
        module, attribute = retired[name]
        return getattr(importlib.import_module(module), attribute)

    listed = sorted(public)
    return resolve, lambda: list(listed)
