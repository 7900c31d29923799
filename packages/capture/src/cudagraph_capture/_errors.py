"""Errors of the capture engines: each names the graph key that failed."""

from __future__ import annotations

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
