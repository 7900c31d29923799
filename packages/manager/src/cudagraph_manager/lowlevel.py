"""The low-level tier: the manager's seam for other capture engines.

``GraphEngineFactory`` builds the engine that captures and replays a model
for one runtime mode (``ManagerOptions.engine_factory``; the default is
``cudagraph_capture.graph_engine``): another capture backend, or a fake for
tests without a GPU. Code that takes a factory as an argument names it
with this protocol (its call is generic over the model's output type).
"""

from typing import TYPE_CHECKING, Final

from cudagraph_dispatch._retired import resolver as _resolver

from ._values._protocols import GraphEngineFactory as GraphEngineFactory

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._values._protocols import ModelOutput as ModelOutput

__all__ = ["GraphEngineFactory"]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "ModelOutput": ("cudagraph_manager._values._protocols", "ModelOutput"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
