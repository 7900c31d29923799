"""Run-time argument checks for public entry points, shared by every package.

Callers are often untyped engine code, so a public function checks what its
signature promises: an error names the argument and the value, before any
state changes. ``bool`` is an ``int`` subclass in Python, but ``True`` is
never a meaningful count, and a string is never a flag.

Both checks raise ``ValueError``, for a wrong type as well as a wrong value:
callers catch one exception type for "bad argument".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def check_int(field: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an integer in ``[minimum, maximum]``, else a ``ValueError`` naming both.

    ``bool`` is rejected (``True`` is not a count); subclasses of ``int``
    (an ``IntEnum``) are accepted.

    Args:
        field: the checked argument's name, which an error starts with.
        value: the argument as the caller gave it (callers may not be typed).
        minimum: the smallest value accepted.
        maximum: the largest value accepted; ``None``: no upper bound.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``value`` is no integer or out of range (naming ``field``
            and ``value``); or ``field`` is no name, or a bound no integer
            (naming ``field``, ``minimum`` or ``maximum``).
    """
    try:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{_name(field)}: expected an integer >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{_name(field)}: expected an integer <= {maximum}, got {value!r}")
    except TypeError:  # the bounds themselves are no integers: the caller's own arguments are wrong
        _check_bounds(minimum, maximum)
        raise
    return value


def check_bool(field: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; else a ``ValueError`` naming ``field`` and ``value``.

    Stand-ins (``1``, ``"no"``, ``None``) are rejected whatever their truth
    value: ``"no"`` is truthy.

    Args:
        field: the checked argument's name, which an error starts with.
        value: the argument as the caller gave it.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``value`` is not ``True`` or ``False`` (naming ``field``
            and ``value``), or ``field`` is no name.
    """
    if value is not True and value is not False:
        raise ValueError(f"{_name(field)}: expected True or False, got {value!r}")
    return value


def _name(field: object) -> str:
    """``field``, the name an error starts with; a ``ValueError`` naming ``field`` if it is no name.

    Runs only where a check fails: the checks cost nothing more where they pass.
    """
    if not isinstance(field, str) or not field:
        raise ValueError(f"field: expected the checked argument's name (a non-empty str), got {field!r}")
    return field


def _check_bounds(minimum: object, maximum: object) -> None:
    """``ValueError`` naming ``minimum`` or ``maximum`` (``check_int``'s own) where it is no integer."""
    if not isinstance(minimum, int) or isinstance(minimum, bool):
        raise ValueError(f"minimum: expected an integer, got {minimum!r}")
    if maximum is not None and (not isinstance(maximum, int) or isinstance(maximum, bool)):
        raise ValueError(f"maximum: expected an integer or None, got {maximum!r}")


def check_items(field: str, value: object, what: str) -> Iterable[object]:
    """``value`` if it is an iterable of items, else a ``ValueError`` naming ``field`` and ``value``.

    Any iterable a caller may hold its items in passes: a list, tuple, set,
    ``range`` or generator (the items are checked by the caller). A string or
    bytes is refused (its items are characters), and so is a mapping:
    iterating one yields its keys and drops its values, which is never what
    was meant. ``what`` says what the items are, for the message.
    """
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, bytearray, Mapping)):
        raise ValueError(f"{field}: expected an iterable of {what} (a list, tuple or set), got {value!r:.80}")
    return value


def check_dims(field: str, value: object, *, minimum: int) -> tuple[int, ...]:
    """``value`` as a tuple of integers ``>= minimum`` (a tensor shape), else ``ValueError`` naming ``field``.

    A sequence of ints: a list, tuple or ``torch.Size``; a string, bytes or
    a ``bool`` dimension is refused.
    """
    dims = tuple(value) if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else None
    if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) and d >= minimum for d in dims):
        raise ValueError(f"{field}: expected a sequence of integers >= {minimum}, got {value!r:.80}")
    return dims
