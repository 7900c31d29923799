"""The one retry rule of every capture: a capture that CUDA invalidated may succeed when tried again.

A recording fails for one of two kinds of reasons. CUDA invalidated the
stream capture: an operation a capture refuses ran while it recorded (a
synchronization or a library handle's creation on the capturing thread, a
first use that a warm-up makes; a device-wide synchronization on another
thread); the engines raise ``CaptureInvalidatedError`` there, and the same
capture may succeed when tried again. Or the work failed while the capture
stayed valid (the model's own error, an out-of-memory, a refusal of
``set_capture_enabled(False)``): trying again fails again. The decision is
made on the exception types along the cause chain, never on their text.

Who retries: ``capture()`` a recording of a key it did not warm up, once,
after the key's warm-up (``_warm_up``); a background capture each key up to
``RETRIES`` more times (``_background``); a lockstep capture alike, on every
rank where every failed rank's error is worth it (``_together``).
"""

from __future__ import annotations

from typing import Final

import torch

from cudagraph_capture import CaptureDisabledError, CaptureInvalidatedError

#: More tries of a key whose background (or lockstep) capture CUDA invalidated.
RETRIES: Final = 2
#: Errors that no retry mends, wherever they sit in a cause chain.
_NEVER: Final = (CaptureDisabledError, torch.OutOfMemoryError)


def worth_retrying(error: BaseException) -> bool:
    """Whether the capture that raised ``error`` may succeed when tried again: CUDA invalidated it.

    True where a ``CaptureInvalidatedError`` is in the chain (``error``, then
    each ``__cause__``, else ``__context__``; a link seen twice ends the walk)
    and neither a capture refusal (``CaptureDisabledError``) nor an
    out-of-memory (``torch.OutOfMemoryError``) is.
    """
    invalidated = False
    seen: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and not any(link is other for other in seen):  # a chain set by hand may loop
        if isinstance(link, _NEVER):
            return False
        invalidated = invalidated or isinstance(link, CaptureInvalidatedError)
        seen.append(link)
        link = link.__cause__ or link.__context__
    return invalidated
