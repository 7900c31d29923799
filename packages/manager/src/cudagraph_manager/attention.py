"""The attention tier: what an attention backend needs to run under the manager's graphs.

``AttentionOptions`` tells a manager the attention's support and builder. A
backend's ``AttentionMetadataBuilder`` builds its metadata for each batch
(``StepBatch``) as the forward runs it (``BatchShape``); the model reads it
with ``attention_metadata(builder)``; ``pad_offsets`` and ``pad_rows`` pad
per-request tensors as graphs read them; ``metadata_extra`` hands a
builder's metadata to a forward run outside the manager;
``PackedMetadataBuilder`` builds the metadata of packed items (encoders)
keyed by token budget. ``check_attention_support`` checks the level a
backend declares against replays. When the manager calls what:
docs/design.md, "The attention seam".
"""

from typing import TYPE_CHECKING, Final

from cudagraph_dispatch._retired import resolver as _resolver

from ._attention._packed import PackedMetadata as PackedMetadata
from ._attention._packed import PackedMetadataBuilder as PackedMetadataBuilder
from ._attention._seam import attention_metadata as attention_metadata
from ._attention._seam import metadata_extra as metadata_extra
from ._attention._seam import pad_offsets as pad_offsets
from ._attention._seam import pad_rows as pad_rows
from ._options import AttentionOptions as AttentionOptions
from ._support_check import BatchKind as BatchKind
from ._support_check import SupportCheckOptions as SupportCheckOptions
from ._support_check import SupportLevelError as SupportLevelError
from ._support_check import check_attention_support as check_attention_support
from ._values._batch import BatchShape as BatchShape
from ._values._batch import StepBatch as StepBatch
from ._values._protocols import AttentionMetadataBuilder as AttentionMetadataBuilder

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._support_check import KindCheck as KindCheck
    from ._support_check import SupportCheck as SupportCheck

__all__ = [
    "AttentionMetadataBuilder",
    "AttentionOptions",
    "BatchKind",
    "BatchShape",
    "PackedMetadata",
    "PackedMetadataBuilder",
    "StepBatch",
    "SupportCheckOptions",
    "SupportLevelError",
    "attention_metadata",
    "check_attention_support",
    "metadata_extra",
    "pad_offsets",
    "pad_rows",
]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "KindCheck": ("cudagraph_manager._support_check", "KindCheck"),
    "SupportCheck": ("cudagraph_manager._support_check", "SupportCheck"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
