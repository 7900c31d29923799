"""The forward context: the dispatch decision, visible to the graph wrappers.

It lives in a ``contextvars.ContextVar``, so threads and asyncio tasks never
see each other's decisions. Entering and leaving costs one ``set`` and one
``reset``: this is on the per-step path.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from types import MappingProxyType, TracebackType
from typing import Final, NamedTuple

from ._descriptor import BatchDescriptor
from ._modes import CUDAGraphMode


class ForwardContext(NamedTuple):
    """What the current forward runs as: the mode, the graph key, and extras.

    ``extra`` holds whatever else the engine passes to its layers (attention
    metadata, slot mappings); it is read-only. A named tuple rather than a
    dataclass: one is built per step, and a tuple builds several times faster.
    Unchecked on purpose: ``set_forward_context`` builds it from the
    arguments it checks; a context is read, never taken from a caller.

    Attributes:
        runtime_mode: NONE, PIECEWISE or FULL.
        batch_descriptor: the graph's key (``None`` only with NONE).
        extra: the extras passed to ``set_forward_context``, read-only.
    """

    runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None
    extra: Mapping[str, object] = MappingProxyType({})


_NO_EXTRA: Final[Mapping[str, object]] = MappingProxyType({})
_NONE: Final = CUDAGraphMode.NONE
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
_FULL: Final = CUDAGraphMode.FULL
_CURRENT: Final[contextvars.ContextVar[ForwardContext | None]] = contextvars.ContextVar(
    "cudagraph_forward_context", default=None
)

#: The context variable itself, for hot paths that read it without a call.
FORWARD_CONTEXT_VAR: Final = _CURRENT


def get_forward_context() -> ForwardContext | None:
    """The active forward context, or ``None`` outside ``set_forward_context``."""
    return _CURRENT.get()


class set_forward_context:  # noqa: N801 - used as a function-style context manager
    """Make ``(runtime_mode, batch_descriptor, **extra)`` the active context.

    Usable as ``with set_forward_context(mode, key): model(...)``; contexts
    nest and the previous one is restored on exit, also on an exception.
    Entering it returns the ``ForwardContext``; one object is entered once
    at a time (``RuntimeError`` otherwise).

    Args:
        runtime_mode: NONE, PIECEWISE or FULL.
        batch_descriptor: the graph's key; required for PIECEWISE and FULL.
        **extra: whatever else the forward's layers read (attention
            metadata), under ``ForwardContext.extra``.

    Raises:
        ValueError: a mode that is no runtime mode, or a missing or wrong
            descriptor, naming the argument.
    """

    __slots__ = ("_context", "_token")

    def __init__(
        self,
        runtime_mode: CUDAGraphMode,
        batch_descriptor: BatchDescriptor | None = None,
        **extra: object,
    ) -> None:
        if runtime_mode is not _NONE and runtime_mode is not _PIECEWISE and runtime_mode is not _FULL:
            raise ValueError(f"runtime_mode: expected NONE, PIECEWISE or FULL, got {runtime_mode!r}")
        if batch_descriptor is None:
            if runtime_mode is not _NONE:
                raise ValueError(f"batch_descriptor: required for runtime_mode {runtime_mode.name}, got None")
        elif batch_descriptor.__class__ is not BatchDescriptor:
            raise ValueError(f"batch_descriptor: expected a BatchDescriptor, got {batch_descriptor!r}")
        self._context = ForwardContext(
            runtime_mode, batch_descriptor, MappingProxyType(extra) if extra else _NO_EXTRA
        )
        self._token: contextvars.Token[ForwardContext | None] | None = None

    def __enter__(self) -> ForwardContext:
        if self._token is not None:
            raise RuntimeError("set_forward_context: this context is already active")
        self._token = _CURRENT.set(self._context)
        return self._context

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token, self._token = self._token, None
        assert token is not None
        _CURRENT.reset(token)
