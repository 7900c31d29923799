"""Errors of the capture engines: each names the graph key that failed."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from cudagraph_dispatch import BatchDescriptor


class CaptureError(RuntimeError):
    """A capture failed; ``descriptor`` is its graph key (``None`` outside a wrapper).

    The failed entry is dropped: the wrapper that raised stays usable.
    """

    def __init__(self, message: str, descriptor: BatchDescriptor | None = None) -> None:
        if descriptor is not None:
            message = f"{message} [descriptor: {descriptor}]"
        super().__init__(message)
        self.descriptor = descriptor


class CaptureDisabledError(CaptureError):
    """A capture was attempted after ``set_capture_enabled(False)``."""


@contextlib.contextmanager
def failures_named(engine: str, descriptor: BatchDescriptor | None, what: str) -> Iterator[None]:
    """Errors of a capture of ``what`` (``"the graph"``) for ``descriptor``, named after ``engine``.

    A ``CaptureError`` passes as it is; another ``Exception`` is raised as a
    ``CaptureError`` naming its type, chained to it. ``KeyboardInterrupt`` and
    ``SystemExit`` are never wrapped, but get a note of what they interrupted.
    """
    try:
        yield
    except CaptureError:
        raise
    except Exception as error:
        raise CaptureError(
            f"{engine}: capture failed with {type(error).__name__}: {error}", descriptor
        ) from error
    except BaseException as error:
        if sys.version_info >= (3, 11):
            error.add_note(f"{engine}: interrupted while capturing {what} of {descriptor}")
        raise
