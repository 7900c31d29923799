"""The reference decoder compiled for capture: inductor between the attention break points.

For PIECEWISE over compiled code (vLLM's piecewise backend, without FX graph
splitting), attention must stay opaque to the compiler and still be a break
point at run time. ``compiled_cached_attention`` is one custom op whose
implementation is ``breakable_cached_attention``: dynamo and inductor see an
op that writes the cache and ``out`` in place and compile the code between
two such calls; when the compiled code calls it during a breakable capture,
the eager break ends the graph segment, runs attention eagerly and starts
the next segment, inside the compiled forward. Everywhere else (a FULL
capture, eager steps) it is plain attention, so one compiled model serves
FULL, PIECEWISE and FULL_AND_PIECEWISE managers.

Importing this module registers the op ``cudagraph_manager::breakable_cached_attention``
(``examples`` does not import it).
"""

from __future__ import annotations

from typing import Final

import torch

from cudagraph_manager import CompiledModel, compile_for_capture

from .reference import ReferenceDecoder, static_inputs
from .reference_attention import breakable_cached_attention

#: ``cached_attention`` behind a break point, as one opaque op for the compiler.
compiled_cached_attention: Final = torch.library.custom_op(
    "cudagraph_manager::breakable_cached_attention",
    breakable_cached_attention,
    mutates_args=("kv_cache", "out"),
)


@compiled_cached_attention.register_fake
def _no_outputs(*args: torch.Tensor) -> None:
    """The op's shape function for tracing: it returns nothing, only writes its arguments."""


def compile_decoder(model: ReferenceDecoder, *, mode: str = "default") -> CompiledModel[torch.Tensor]:
    """``model`` calling ``compiled_cached_attention``, compiled for capture (weights and caches shared).

    One compile serves every step of two or more tokens, and a second one
    steps of one token (see ``compile_for_capture``); the compile happens on
    the first call, which a manager's ``capture()`` makes.
    """
    given: object = model
    if not isinstance(given, ReferenceDecoder):
        raise ValueError(f"model: expected a ReferenceDecoder, got {model!r:.80}")
    return compile_for_capture(
        model.with_attention(compiled_cached_attention), static_inputs(model.config), mode=mode
    )
