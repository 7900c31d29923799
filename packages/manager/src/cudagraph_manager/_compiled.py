"""Compiled models for capture: one ``torch.compile`` for every capture size, no inductor graphs.

The manager captures the graphs itself, so the model is compiled the way
vLLM and SGLang compile theirs: inductor without its own CUDA graphs
(``"reduce-overhead"`` would record cudagraph trees inside ours), and one
compile whose token dimension is symbolic, so that capturing 51 sizes does
not mean 51 compiles. ``compile_for_capture`` does both: it refuses the
graph-capturing modes and marks the leading dimension of every batched input
dynamic on each call (the manager's static-buffer views are new sizes of the
same buffers), leaving weights, caches and hidden sizes static.

Nothing here imports ``torch._dynamo`` at module import: ``torch.compile``
loads it when ``compile_for_capture`` is called.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Final, Generic, TypeVar

import torch

from cudagraph_dispatch.lowlevel import check_bool

from ._values._inputs import StaticInput, check_inputs_spec

R = TypeVar("R")

#: Inductor modes that compile without CUDA graphs of inductor's own.
GRAPHLESS_MODES: Final = ("default", "max-autotune-no-cudagraphs")
_GRAPH_MODES: Final = ("reduce-overhead", "max-autotune")
_INDUCTOR: Final = "inductor"


class CompiledModel(Generic[R]):
    """``model`` compiled for capture: call it with the inputs as keyword arguments.

    Each call marks the leading dimension of the batched inputs (``rows`` of
    ``"tokens"`` or ``"reqs"``) dynamic, then calls the compiled model. The
    first call compiles; a call with another row count reuses that compile,
    except a row count of 1, which dynamo specializes (a second compile).
    ``model`` is the callable as given, uncompiled. Made by
    ``compile_for_capture``; one built by hand has its arguments checked
    (``ValueError`` naming them).
    """

    __slots__ = ("_batched", "_mark", "compiled", "model")

    def __init__(self, model: Callable[..., R], compiled: Callable[..., R], batched: tuple[str, ...]) -> None:
        from torch._dynamo import maybe_mark_dynamic  # loaded by torch.compile already

        for name, value in (("model", model), ("compiled", compiled)):
            if not callable(value):
                raise ValueError(f"{name}: expected a callable, got {value!r:.80}")
        given: object = batched
        if not isinstance(given, tuple) or not all(isinstance(n, str) for n in given):
            raise ValueError(f"batched: expected a tuple of input names, got {given!r:.80}")
        self.model: Final = model
        self.compiled: Final = compiled
        self._batched: Final = batched
        self._mark: Final = maybe_mark_dynamic

    def __call__(self, **inputs: torch.Tensor) -> R:
        for name in self._batched:
            tensor = inputs.get(name)
            if tensor is not None:
                self._mark(tensor, 0)  # [rows, ...]: rows symbolic
        return self.compiled(**inputs)

    def __repr__(self) -> str:
        name = getattr(self.model, "__qualname__", type(self.model).__qualname__)
        return f"CompiledModel({name}, batched={self._batched})"


def compile_for_capture(
    model: Callable[..., R],
    inputs: Mapping[str, StaticInput],
    *,
    mode: str = "default",
    fullgraph: bool = True,
    backend: str = _INDUCTOR,
) -> CompiledModel[R]:
    """Compile ``model`` once for every capture size, for ``CUDAGraphManager`` to capture.

    Args:
        model: the model to compile (an instance or a function, not a class).
        inputs: the manager's inputs: the leading dimension of each batched
            one is dynamic, all other dimensions static.
        mode: an inductor mode without CUDA graphs (``"default"`` or
            ``"max-autotune-no-cudagraphs"``); inductor's CUDA graphs stay off
            whatever its global config says.
        fullgraph: a graph break is an error instead of a split into several
            compiled pieces with eager code between them.
        backend: another dynamo backend (``"aot_eager"``, ``"eager"``) for
            debugging; ``mode`` then must stay ``"default"``.

    Returns:
        The compiled model, to pass to ``CUDAGraphManager``; it compiles on
        its first call.

    Raises:
        ValueError: naming a bad argument (a graph-capturing mode among them).
    """
    if not callable(model):
        raise ValueError(f"model: expected a callable, got {model!r:.80}")
    if isinstance(model, type):
        raise ValueError(
            f"model: expected the model to compile (an instance or a function), got the class "
            f"{model.__name__}; pass an instance ({model.__name__}(...))"
        )
    checked = check_inputs_spec(inputs)
    _check_mode(mode, backend)
    check_bool("fullgraph", fullgraph)
    if backend == _INDUCTOR:
        from torch._inductor import list_mode_options

        options = list_mode_options(mode)
        options["triton.cudagraphs"] = False
        compiled = torch.compile(model, fullgraph=fullgraph, dynamic=False, backend=backend, options=options)
    else:
        compiled = torch.compile(model, fullgraph=fullgraph, dynamic=False, backend=backend)
    batched = tuple(name for name, spec in checked.items() if spec.rows is not None)
    return CompiledModel(model, compiled, batched)


def _check_mode(mode: object, backend: object) -> None:
    """``ValueError`` naming ``backend`` or ``mode`` where they are not a graphless compile."""
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend: expected the name of a torch.compile backend, got {backend!r}")
    if mode in _GRAPH_MODES:
        raise ValueError(
            f"mode: {mode!r} records CUDA graphs of inductor's own, and the manager captures the "
            f"graphs; use one of {GRAPHLESS_MODES}"
        )
    if mode not in GRAPHLESS_MODES:
        raise ValueError(f"mode: expected one of {GRAPHLESS_MODES}, got {mode!r}")
    if backend != _INDUCTOR and mode != "default":
        raise ValueError(f"mode: {mode!r} is an inductor mode, but backend is {backend!r}")
    if backend != _INDUCTOR:
        from torch._dynamo import list_backends  # only where another backend is named: dynamo loads here

        known = list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"backend: expected a torch.compile backend ({', '.join(sorted(known))}), got {backend!r}"
            )


def dynamo_compiles() -> int | None:
    """Graphs dynamo has compiled in this process so far, recompiles included.

    ``None`` when ``torch._dynamo`` was never imported (then nothing was
    compiled, and this does not import it). The count is dynamo's
    ``counters["stats"]["unique_graphs"]``: one per graph handed to the
    backend, so a recompile counts once more, and so does each piece of a
    model split by graph breaks. ``torch._dynamo.utils.counters.clear()``
    resets it.
    """
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    counters: Mapping[str, Mapping[str, int]] = utils.counters
    return int(counters["stats"]["unique_graphs"])


def compiles_since(before: int | None) -> int | None:
    """Graphs dynamo compiled since ``dynamo_compiles()`` returned ``before``; ``None``: dynamo never loaded.

    ``before`` is ``None`` when the first compile came after it; a count
    reset meanwhile (``counters.clear()``) gives at least 0.
    """
    after = dynamo_compiles()
    return None if after is None else max(0, after - (before or 0))
