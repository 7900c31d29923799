"""Errors of the capture engines: each names the graph key that failed."""

from __future__ import annotations

import sys

from cudagraph_dispatch import BatchDescriptor


class CaptureError(RuntimeError):
    """A capture failed; ``descriptor`` is its graph key (``None`` outside a wrapper).

    The failed entry is dropped: the wrapper that raised stays usable.

    Args:
        message: what failed and why.
        descriptor: the graph key that failed, appended to the message.

    Raises:
        ValueError: ``message`` is no string or ``descriptor`` no key (an
            engine of the caller's raises these too).
    """

    def __init__(self, message: str, descriptor: BatchDescriptor | None = None) -> None:
        given: object = message  # an engine of the caller's raises these too: checked at run time
        if not isinstance(given, str):
            raise ValueError(f"message: expected the error's message (a str), got {given!r:.80}")
        if descriptor is not None and not isinstance(descriptor, BatchDescriptor):
            raise ValueError(f"descriptor: expected None or a BatchDescriptor, got {descriptor!r:.80}")
        if descriptor is not None:
            message = f"{message} [descriptor: {descriptor}]"
        super().__init__(message)
        self.descriptor = descriptor


class CaptureDisabledError(CaptureError):
    """A capture was attempted after ``set_capture_enabled(False)``."""


class CaptureInvalidatedError(CaptureError):
    """CUDA invalidated the stream capture: the same capture may succeed when tried again.

    An operation a capture refuses ran while it recorded: a synchronization
    or a library handle's creation on the capturing thread (a first use a
    warm-up makes), or a device-wide synchronization on another thread. The
    engines raise it where CUDA refused to end the capture, ``from`` the
    error the work raised, if any; a failure of the work itself while the
    capture stayed valid (the model's own error, an out-of-memory) is a plain
    ``CaptureError``.
    """


def capture_failure(engine: str, error: Exception, descriptor: BatchDescriptor | None) -> CaptureError:
    """The ``CaptureError`` an engine raises ``from error``, naming the error's type and ``descriptor``.

    Raised by the caller's own ``except`` clause, never from a frame or a
    generator of ours that would keep the failed capture's tensors alive
    through the traceback until a garbage collection.
    """
    return CaptureError(f"{engine}: capture failed with {type(error).__name__}: {error}", descriptor)


def invalidated_capture(
    engine: str, error: Exception, descriptor: BatchDescriptor | None
) -> CaptureInvalidatedError:
    """The ``CaptureInvalidatedError`` an engine raises ``from error`` where CUDA invalidated the capture."""
    return CaptureInvalidatedError(
        f"{engine}: CUDA invalidated the capture; the work raised {type(error).__name__}: {error}", descriptor
    )


def note_interrupt(error: BaseException, engine: str, what: str, descriptor: BatchDescriptor | None) -> None:
    """Note on a ``KeyboardInterrupt`` or ``SystemExit`` what it interrupted (they are never wrapped)."""
    if sys.version_info >= (3, 11):
        error.add_note(f"{engine}: interrupted while capturing {what} of {descriptor}")
