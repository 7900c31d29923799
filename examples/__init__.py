"""Examples built on the manager: the reference decoders, the demo and their backends.

The repository's top-level ``examples/``, shipped in no wheel: run them from
the repository root (``python -m examples.demo``). Imported only on purpose
(``import cudagraph_manager`` never loads them): the reference decoder
registers a ``torch.library`` custom op, and neither it nor the demo belongs
to the library's import path. ``compiled`` (the decoder compiled for
capture; it registers a second op) is not imported here either: import it
on its own. Neither is ``inputs`` (random step inputs): the examples and the
tests import it on purpose.

- ``config``: ``DecoderConfig``; ``body``: the weights every decoder shares.
- ``reference``: ``ReferenceDecoder``, a KV cache row per request.
- ``paged``: ``PagedDecoder`` and its attention backends, on the attention seam.
- ``ep``: data-parallel attention with an expert-parallel MoE (all-to-alls inside the graphs);
  ``ep_moe`` runs it on two ranks. Imported on purpose only.
"""

from .config import DecoderConfig as DecoderConfig
from .reference import ReferenceDecoder as ReferenceDecoder
from .reference import static_inputs as static_inputs

__all__ = ["DecoderConfig", "ReferenceDecoder", "static_inputs"]
