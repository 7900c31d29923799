"""Graph modes: what a forward may run as, and how combined modes split."""

from __future__ import annotations

import enum
from typing import Final


class CUDAGraphMode(enum.Enum):
    """How a forward runs: eagerly, as graph segments, or as one full graph.

    ``NONE``, ``PIECEWISE`` and ``FULL`` are runtime modes: what one forward
    actually does. ``FULL_DECODE_ONLY`` and ``FULL_AND_PIECEWISE`` are
    configuration modes that pick one runtime mode for uniform decode batches
    and another for mixed (prefill and decode) batches.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)  # decode FULL, mixed NONE
    FULL_AND_PIECEWISE = (2, 1)  # decode FULL, mixed PIECEWISE

    # Members are singletons, so hashing by identity is correct; it runs in C,
    # where Enum's own hash (of the name) is a Python call. The dispatcher
    # looks modes up in sets tens of thousands of times while it builds.
    __hash__ = object.__hash__

    def decode_mode(self) -> CUDAGraphMode:
        """The runtime mode used for uniform decode batches."""
        return _DECODE[self]

    def mixed_mode(self) -> CUDAGraphMode:
        """The runtime mode used for mixed prefill/decode batches."""
        return _MIXED[self]

    def separate_routine(self) -> bool:
        """True when decode and mixed batches have routines of their own."""
        return isinstance(self.value, tuple)

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """Whether this mode runs some batches as ``mode``.

        Args:
            mode: a runtime mode (NONE, PIECEWISE or FULL).

        Returns:
            True when ``mode`` is this mode's decode or mixed mode.

        Raises:
            ValueError: ``mode`` is no runtime mode.
        """
        given: object = mode  # checked at run time: callers may not be typed
        if not isinstance(given, CUDAGraphMode) or not given.is_runtime_mode():
            raise ValueError(f"mode: expected a runtime mode (NONE, PIECEWISE, FULL), got {given!r}")
        return mode in (_DECODE[self], _MIXED[self])

    def is_runtime_mode(self) -> bool:
        """True for NONE, PIECEWISE and FULL: modes a single forward can run in."""
        return not isinstance(self.value, tuple)

    @classmethod
    def parse(cls, text: str) -> CUDAGraphMode:
        """The mode named ``text``, case-insensitive.

        Args:
            text: a member's name in any case (``"full_and_piecewise"``);
                surrounding spaces are ignored.

        Returns:
            The mode of that name.

        Raises:
            ValueError: ``text`` is no string, or names no mode (the message
                lists the valid names).
        """
        given: object = text  # checked at run time: callers may not be typed
        if not isinstance(given, str):
            raise ValueError(f"text: expected a CUDA graph mode name, got {given!r}")
        mode = cls.__members__.get(given.strip().upper())
        if mode is None:
            valid = ", ".join(cls.__members__)
            raise ValueError(f"text: unknown CUDA graph mode {given!r}; valid names: {valid}")
        return mode


_BY_VALUE: Final = {m.value: m for m in CUDAGraphMode}
_DECODE: Final[dict[CUDAGraphMode, CUDAGraphMode]] = {
    m: _BY_VALUE[m.value[0]] if isinstance(m.value, tuple) else m for m in CUDAGraphMode
}
_MIXED: Final[dict[CUDAGraphMode, CUDAGraphMode]] = {
    m: _BY_VALUE[m.value[1]] if isinstance(m.value, tuple) else m for m in CUDAGraphMode
}
