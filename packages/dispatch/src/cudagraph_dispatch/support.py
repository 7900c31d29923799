"""What graphs an attention backend supports: the declaration the configured mode is resolved against.

An attention backend declares ``AttentionSupport`` (a ``GraphSupport``
level, and whether PIECEWISE graphs split at it); ``CUDAGraphDispatcher(config,
attention=...)`` resolves the configured mode against it (its
``resolution``), or, with ``strict_attention=True``, raises a ``ValueError``
instead of downgrading. Never imports torch.
"""

from typing import TYPE_CHECKING, Final

from ._retired import resolver as _resolver
from ._support import AttentionSupport as AttentionSupport
from ._support import GraphSupport as GraphSupport

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._support import ModeNotSupportedError as ModeNotSupportedError
    from ._support import ModeResolution as ModeResolution
    from ._support import resolve_mode as resolve_mode

__all__ = ["AttentionSupport", "GraphSupport"]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "ModeNotSupportedError": ("cudagraph_dispatch._support", "ModeNotSupportedError"),
    "ModeResolution": ("cudagraph_dispatch._support", "ModeResolution"),
    "resolve_mode": ("cudagraph_dispatch._support", "resolve_mode"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
