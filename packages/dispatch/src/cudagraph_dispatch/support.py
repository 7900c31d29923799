"""What graphs an attention backend supports, and the configured mode resolved against it.

The attention backends' declaration (``GraphSupport``, ``AttentionSupport``)
and its resolution (``resolve_mode``: ``ModeResolution``, or
``ModeNotSupportedError`` where downgrades are off). Never imports torch.
"""

from ._support import AttentionSupport as AttentionSupport
from ._support import GraphSupport as GraphSupport
from ._support import ModeNotSupportedError as ModeNotSupportedError
from ._support import ModeResolution as ModeResolution
from ._support import resolve_mode as resolve_mode

__all__ = [
    "AttentionSupport",
    "GraphSupport",
    "ModeNotSupportedError",
    "ModeResolution",
    "resolve_mode",
]
