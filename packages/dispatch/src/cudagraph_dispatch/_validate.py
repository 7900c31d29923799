"""Argument checks shared by the value types: errors name field and value."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """True for a real integer (``bool`` is not a size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(field: str, value: object, *, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``, else a ``ValueError`` naming ``field``."""
    if not is_int(value):
        raise ValueError(f"{field}: expected an integer, got {value!r}")
    assert isinstance(value, int)
    if value < minimum:
        raise ValueError(f"{field}: must be >= {minimum}, got {value!r}")
    return value
