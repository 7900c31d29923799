"""A process-wide switch that forbids new captures once start-up is over.

A capture during serving means a batch reached a graph that was never
captured at start-up: slow, and allocating from the graph pool mid-flight.
Engines turn capture off after start-up so that this fails loudly instead.
"""

from __future__ import annotations

from typing import Final

from cudagraph_dispatch import BatchDescriptor
from cudagraph_dispatch.lowlevel import check_bool

from ._errors import CaptureDisabledError

_state: Final = {"enabled": True}


def set_capture_enabled(flag: bool) -> None:
    """Allow or forbid new captures in this process.

    Args:
        flag: ``True`` allows them; ``False`` makes every capture attempt
            raise ``CaptureDisabledError``.

    Raises:
        ValueError: ``flag`` is not ``True`` or ``False``.
    """
    _state["enabled"] = check_bool("flag", flag)


def capture_enabled() -> bool:
    """Whether new captures are allowed."""
    return _state["enabled"]


def capture_disabled_reason() -> str | None:
    """Why no capture may start now, in words; ``None`` while captures are allowed."""
    if _state["enabled"]:
        return None
    return "capture is disabled (set_capture_enabled(False)): no graph may be captured after start-up"


def check_capture_enabled(descriptor: BatchDescriptor | None) -> None:
    """Raise ``CaptureDisabledError`` naming ``descriptor`` if capture is off (the one check).

    ``descriptor`` is the ``BatchDescriptor`` about to be captured, or ``None``
    (a capture of no key); anything else raises ``ValueError``.
    """
    if descriptor is not None and descriptor.__class__ is not BatchDescriptor:
        raise ValueError(f"descriptor: expected None or a BatchDescriptor, got {descriptor!r}")
    why = capture_disabled_reason()
    if why is not None:
        raise CaptureDisabledError(why, descriptor)
