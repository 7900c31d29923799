"""The reference decoder on a paged KV cache, with attention backends on the attention seam.

One module per concern:

- ``layout``: how the cache is paged (``PagedLayout``, the scratch page).
- ``batch``: the step's inputs (``PAGED_INPUT_NAMES``, ``paged_static_inputs``)
  and the metadata every backend builds from them (``PagedMetadata`` in
  ``PagedBuffers``).
- ``base``: what a backend is and what every backend shares: the
  ``PagedBackend`` protocol, and ``EagerBreakAttention``, the backends'
  base (``attend`` as an eager break, written once).
- ``checks``: what makes a step valid, checked on the host on eager steps,
  and on a graph path recorded on the device or checked on the host on
  request (``PagedBuffers``' ``validate``).
- ``flex``, ``gather`` (and ``varlen``, ``split_decode``): the backends;
  ``registry``: the backends by name (``BACKENDS``, ``make_backend``) and
  the check of a backend given (``check_backend``).
- ``model``: ``PagedDecoder``, and ``reserve_paged_cache``: its cache's
  memory reserved before the capture and backed after (``KVCacheMemory``).

Random inputs are in ``examples.inputs``; the float64 oracle is the tests' (``tests.manager.oracles``).

    model = PagedDecoder(config, backend="gather")
    attention = AttentionOptions(metadata_builder=model.backend)
    manager = CUDAGraphManager(
        model, paged_static_inputs(model.layout), dispatch, options=ManagerOptions(attention=attention)
    )
"""

from .base import EagerBreakAttention as EagerBreakAttention
from .base import PagedBackend as PagedBackend
from .batch import PAD_REQUEST as PAD_REQUEST
from .batch import PAGED_INPUT_NAMES as PAGED_INPUT_NAMES
from .batch import PagedBuffers as PagedBuffers
from .batch import PagedMetadata as PagedMetadata
from .batch import paged_static_inputs as paged_static_inputs
from .flex import FlexMetadata as FlexMetadata
from .flex import FlexPagedAttention as FlexPagedAttention
from .flex import tile_unions as tile_unions
from .gather import GatherMetadata as GatherMetadata
from .gather import GatherPagedAttention as GatherPagedAttention
from .layout import PagedLayout as PagedLayout
from .layout import page_of_slot as page_of_slot
from .model import BACKENDS as BACKENDS
from .model import PagedDecoder as PagedDecoder
from .model import make_backend as make_backend
from .model import max_flex_pages as max_flex_pages
from .model import paged_unit_shape as paged_unit_shape
from .model import reserve_paged_cache as reserve_paged_cache

__all__ = [
    "BACKENDS",
    "PAD_REQUEST",
    "PAGED_INPUT_NAMES",
    "EagerBreakAttention",
    "FlexMetadata",
    "FlexPagedAttention",
    "GatherMetadata",
    "GatherPagedAttention",
    "PagedBackend",
    "PagedBuffers",
    "PagedDecoder",
    "PagedLayout",
    "PagedMetadata",
    "make_backend",
    "paged_static_inputs",
    "page_of_slot",
    "paged_unit_shape",
    "max_flex_pages",
    "reserve_paged_cache",
    "tile_unions",
]
