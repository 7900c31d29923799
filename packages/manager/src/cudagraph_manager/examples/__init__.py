"""Examples built on the manager: the reference decoder and the demo.

Imported only on purpose (``import cudagraph_manager`` does not load this
package): the reference decoder registers a ``torch.library`` custom op, and
neither it nor the demo belongs to the library's import path. ``compiled``
(the decoder compiled for capture; it registers a second op) is not imported
here either: import it on its own.
"""

from .reference import DecoderConfig as DecoderConfig
from .reference import ReferenceDecoder as ReferenceDecoder
from .reference import make_step_inputs as make_step_inputs
from .reference import static_inputs as static_inputs

__all__ = ["DecoderConfig", "ReferenceDecoder", "make_step_inputs", "static_inputs"]
