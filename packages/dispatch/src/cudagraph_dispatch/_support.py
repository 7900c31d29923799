"""What an attention can graph, and the configured mode resolved against it.

An attention backend declares a support level (vLLM's ``AttentionCGSupport``):
which batches a FULL graph that contains it replays correctly. The model's
level is the lowest of its backends'. ``resolve_mode`` downgrades the
configured mode until every FULL graph it implies is one the level can serve,
following vLLM's ``GPUModelRunner._check_and_update_cudagraph_mode`` (the
rules are in docs/design.md, "Attention support"); it never upgrades.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable
from typing import Final

from ._checks import check_bool, check_items
from ._config import DispatchConfig
from ._modes import CUDAGraphMode

_LOG: Final = logging.getLogger("cudagraph_dispatch")

_NONE: Final = CUDAGraphMode.NONE
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
_FULL: Final = CUDAGraphMode.FULL


class GraphSupport(enum.IntEnum):
    """Which batches a FULL graph containing an attention replays correctly, weakest first.

    ``NEVER``: none (its metadata is built on the host per step).
    ``UNIFORM_SINGLE_TOKEN_DECODE``: uniform batches of one token per request.
    ``UNIFORM_BATCH``: uniform batches of any query length (spec decode).
    ``ALWAYS``: any batch, mixed prefill and decode included.
    """

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionSupport:
    """What a model's attention declares: its level, and whether PIECEWISE graphs split at it.

    ``piecewise``: the attention runs eagerly between the segments of a
    PIECEWISE graph (vLLM: attention is among the splitting ops), so
    PIECEWISE graphs are a fallback that needs no level at all. ``weakest``
    combines the backends of one model.

    Args:
        level: what a FULL graph holding the attention replays correctly.
        piecewise: PIECEWISE graphs split at the attention (it runs eagerly
            between their segments).
        name: the backend's name in logs and reports, not empty.

    Raises:
        ValueError: a bad field, naming it.
    """

    level: GraphSupport = GraphSupport.ALWAYS
    piecewise: bool = True
    name: str = "attention"

    def __post_init__(self) -> None:
        if not isinstance(self.level, GraphSupport):  # callers may not be typed
            raise ValueError(f"level: expected a GraphSupport, got {self.level!r}")
        check_bool("piecewise", self.piecewise)
        given: object = self.name
        if not isinstance(given, str) or not given:
            raise ValueError(f"name: expected a non-empty string, got {given!r}")

    @classmethod
    def weakest(cls, supports: Iterable[AttentionSupport]) -> AttentionSupport:
        """The model's support: the lowest level of its backends (the first such names it).

        PIECEWISE graphs are available only if every backend splits them.

        Args:
            supports: every backend's ``AttentionSupport``, any iterable.

        Returns:
            The weakest level, split only where every backend splits; no
            backend at all (an attention-free model): ``ALWAYS``.

        Raises:
            ValueError: ``supports`` is no iterable of ``AttentionSupport``,
                naming it (or the item, ``supports[i]``).
        """
        check_items("supports", supports, "AttentionSupport")  # callers may not be typed
        found = list(supports)
        for i, support in enumerate(found):
            if not isinstance(support, AttentionSupport):
                raise ValueError(f"supports[{i}]: expected an AttentionSupport, got {support!r}")
        if not found:
            return cls(name="no attention")
        weakest = min(found, key=lambda s: s.level)  # min keeps the first of equals
        return dataclasses.replace(weakest, piecewise=all(s.piecewise for s in found))


class ModeNotSupportedError(ValueError):
    """The configured mode needs FULL graphs its attention cannot replay, and downgrades are off."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModeResolution:
    """The configured mode resolved against the attention: the mode used, and each downgrade's reason."""

    requested: CUDAGraphMode
    mode: CUDAGraphMode
    support: AttentionSupport
    uniform_decode_query_len: int
    #: Why each downgrade happened, in order; empty when the mode stands.
    reasons: tuple[str, ...] = ()

    @property
    def downgraded(self) -> bool:
        return self.mode is not self.requested

    def __str__(self) -> str:
        head = f"{self.requested.name} -> {self.mode.name}" if self.downgraded else self.mode.name
        level = f"{self.support.name} supports {self.support.level.name}"
        return f"{head} ({level}{'; ' if self.reasons else ''}{'; '.join(self.reasons)})"


def resolve_mode(
    config: DispatchConfig, support: AttentionSupport, *, strict: bool = False
) -> ModeResolution:
    """``config.mode`` downgraded until ``support`` serves every graph it implies.

    vLLM's policy in its order, with a step 0 for an attention that does not
    split (docs/design.md, "Attention support", states the rules). Each
    downgrade is logged once, at WARNING, with its reason; ``strict=True``
    raises ``ModeNotSupportedError`` instead of the first. A bad argument
    raises ``ValueError`` naming it.
    """
    _check_resolve_arguments(config, support, strict)
    level, query_len, split = support.level, config.uniform_decode_query_len, support.piecewise
    downgrade = _Downgrades(config, support, strict)
    mode = config.mode
    fallback = _PIECEWISE if split else _NONE
    fallback_why = "PIECEWISE graphs split at the attention" if split else "the attention does not split"
    if not split and mode.mixed_mode() is _PIECEWISE and level is not GraphSupport.ALWAYS:
        mode = downgrade(
            mode,
            CUDAGraphMode.FULL_DECODE_ONLY if mode.decode_mode() is _FULL else _NONE,
            "the attention does not split, so PIECEWISE graphs hold it and serve mixed batches: "
            "that needs ALWAYS",
        )
    if mode.mixed_mode() is _FULL and level is not GraphSupport.ALWAYS:
        mode = downgrade(
            mode,
            CUDAGraphMode.FULL_AND_PIECEWISE if split else CUDAGraphMode.FULL_DECODE_ONLY,
            "mixed prefill/decode batches need ALWAYS for FULL graphs",
        )
    if mode.decode_mode() is _FULL and level is GraphSupport.NEVER:
        mode = downgrade(mode, fallback, f"no FULL graph at NEVER; {fallback_why}")
    if mode.decode_mode() is _FULL and query_len > 1 and level < GraphSupport.UNIFORM_BATCH:
        why = f"uniform decode of {query_len} tokens per request needs UNIFORM_BATCH; {fallback_why}"
        mode = downgrade(mode, fallback, why)
    return ModeResolution(config.mode, mode, support, query_len, tuple(downgrade.reasons))


def _check_resolve_arguments(config: object, support: object, strict: object) -> None:
    """``resolve_mode``'s arguments: ``ValueError`` naming the first bad one."""
    if not isinstance(config, DispatchConfig):
        raise ValueError(f"config: expected a DispatchConfig, got {config!r}")
    if not isinstance(support, AttentionSupport):
        raise ValueError(f"support: expected an AttentionSupport, got {support!r}")
    check_bool("strict", strict)


class _Downgrades:
    """One resolution's downgrades, in order: each logged at WARNING, or the first raised if ``strict``."""

    __slots__ = ("config", "reasons", "strict", "support")

    def __init__(self, config: DispatchConfig, support: AttentionSupport, strict: bool) -> None:
        self.config: Final = config
        self.support: Final = support
        self.strict: Final = strict
        self.reasons: Final[list[str]] = []

    def __call__(self, mode: CUDAGraphMode, to: CUDAGraphMode, why: str) -> CUDAGraphMode:
        """``to``, the mode that ``mode`` is downgraded to because ``why``; raises if ``strict``."""
        support, message = self.support, f"{mode.name} -> {to.name}: {why}"
        if self.strict:
            raise ModeNotSupportedError(
                f"mode: {self.config.mode.name} needs FULL graphs that {support.name} "
                f"({support.level.name}) cannot replay: {why}; pass {to.name}, or resolve without strict"
            )
        _LOG.warning("CUDA graph mode %s (%s supports %s)", message, support.name, support.level.name)
        self.reasons.append(message)
        return to
