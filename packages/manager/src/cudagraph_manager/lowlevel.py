"""The low-level tier: the manager's seams for engines and models built on it.

``GraphEngineFactory`` builds the engine that captures and replays a model
for one runtime mode (the default is ``cudagraph_capture.graph_engine``);
``ModelOutput`` is what a model may return.
"""

from ._values._protocols import GraphEngineFactory as GraphEngineFactory
from ._values._protocols import ModelOutput as ModelOutput

__all__ = ["GraphEngineFactory", "ModelOutput"]
