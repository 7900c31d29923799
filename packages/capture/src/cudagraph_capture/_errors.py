"""Errors of the capture engines: each names the graph key that failed."""

from __future__ import annotations

import sys

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


def named_failure(
    error: BaseException, engine: str, descriptor: BatchDescriptor | None, what: str
) -> BaseException:
    """What a capture of ``what`` for ``descriptor`` raises for ``error``, named after ``engine``.

    A ``CaptureError`` as it is; another ``Exception`` as a ``CaptureError``
    naming its type (the caller chains it: ``raise named from error``);
    ``KeyboardInterrupt`` and ``SystemExit`` as they are, with a note of what
    they interrupted. A function, not a context manager, so that the caller's
    own ``except`` raises: no frame of ours holds the failed capture's tensors.
    """
    if isinstance(error, CaptureError):
        return error
    if isinstance(error, Exception):
        return CaptureError(f"{engine}: capture failed with {type(error).__name__}: {error}", descriptor)
    if sys.version_info >= (3, 11):
        error.add_note(f"{engine}: interrupted while capturing {what} of {descriptor}")
    return error
