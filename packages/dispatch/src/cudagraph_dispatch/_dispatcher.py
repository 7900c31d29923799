"""The dispatcher: the one source of truth for which graphs exist.

``CUDAGraphDispatcher`` builds the graphs of a config once (``DispatchRule``)
and answers ``dispatch`` and ``route`` from the rule's tables, one decision
per padding bucket; ``explain`` asks the rule itself and words its reason.
"""

from __future__ import annotations

import dataclasses
import logging
from bisect import bisect_left
from typing import Final

from ._checks import check_bool
from ._config import DispatchConfig
from ._descriptor import BatchDescriptor
from ._modes import CUDAGraphMode
from ._request import NO_MODES, RankRequest
from ._rule import Dispatch, DispatchRule, Route, why_no_keys
from ._support import AttentionSupport, ModeResolution, resolve_mode

_LOG: Final = logging.getLogger("cudagraph_dispatch")

_NONE: Final = CUDAGraphMode.NONE
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
_FULL: Final = CUDAGraphMode.FULL


class CUDAGraphDispatcher:
    """Maps a batch (token count, uniformity, LoRA count) to a graph key.

    The keys built here are the only graphs that exist: the capture plan
    lists them, and ``dispatch`` only ever returns one of them (or ``NONE``).

    Args:
        config: the mode, the sizes and the batch limits.
        attention: what the model's attention supports (``None``: any
            batch, ``ALWAYS``); the configured mode is resolved against it,
            downgraded where a FULL graph would hold an attention that cannot
            replay its batches (``resolution`` says why).
        strict_attention: raise instead of downgrading.

    Raises:
        ValueError: a bad argument, naming it; with ``strict_attention``, a
            mode the attention cannot serve (naming the mode and the level).
    """

    __slots__ = (
        "_bounds",
        "_config",
        "_dense_buckets",
        "_keys",
        "_lora_cases",
        "_max_num_seqs",
        "_max_uniform_tokens",
        "_num_dense_buckets",
        "_resolution",
        "_rule",
        "_tables",
        "_uniform_decode_query_len",
    )

    def __init__(
        self,
        config: DispatchConfig,
        *,
        attention: AttentionSupport | None = None,
        strict_attention: bool = False,
    ) -> None:
        # The keys follow the mode the attention can serve, never a mode above it.
        self._resolution: Final = _resolved(config, attention, strict_attention)
        if self._resolution.downgraded:
            config = dataclasses.replace(config, mode=self._resolution.mode)
        self._config: Final = config
        self._rule: Final = DispatchRule(config)
        self._keys: Final = self._rule.keys
        if config.mode is not _NONE and not self._keys:  # a config that asks for graphs and gets none
            _LOG.warning("CUDA graph mode %s plans no graph: %s", config.mode.name, why_no_keys(config))
        elif _asks_for_decode_graphs(config) and not any(key.uniform for key in self._keys.get(_FULL, ())):
            _LOG.warning(
                "CUDA graph mode %s plans no FULL graph for uniform decode batches (they run on the "
                "mixed batches' graphs): %s",
                config.mode.name,
                why_no_keys(config),
            )
        # What route reads every step, held here so that it reaches each without a call.
        self._lora_cases: Final = self._rule.lora_cases
        self._uniform_decode_query_len: Final = config.uniform_decode_query_len
        self._max_num_seqs: Final = config.max_num_seqs
        # A uniform decode batch has num_tokens / q requests, at most max_num_seqs.
        self._max_uniform_tokens: Final = config.uniform_decode_query_len * config.max_num_seqs
        self._bounds: Final = config.capture_sizes.bounds  # the count -> padding bucket look-up
        self._dense_buckets: Final = config.capture_sizes.dense_buckets
        self._num_dense_buckets: Final = len(self._dense_buckets)
        self._tables: Final = self._rule.all_tables()

    @property
    def config(self) -> DispatchConfig:
        """The configuration the graphs were built from: its mode is the resolved one."""
        return self._config

    @property
    def resolution(self) -> ModeResolution:
        """The configured mode resolved against the attention's support, and why it was downgraded."""
        return self._resolution

    def keys(self, mode: CUDAGraphMode) -> frozenset[BatchDescriptor]:
        """The keys captured for one runtime mode.

        Args:
            mode: NONE, PIECEWISE or FULL.

        Returns:
            The keys of that mode (empty for NONE).

        Raises:
            ValueError: ``mode`` is no runtime mode.
        """
        given: object = mode
        if not isinstance(given, CUDAGraphMode) or not given.is_runtime_mode():
            raise ValueError(f"mode: expected NONE, PIECEWISE or FULL, got {mode!r}")
        return self._keys.get(mode, frozenset())

    def dispatch(
        self,
        num_tokens: int,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
    ) -> Dispatch:
        """The graph to run ``num_tokens`` tokens with: ``(mode, key)``.

        Tries, in order, the uniform FULL key (``uniform_decode`` only), the
        exact FULL key and the relaxed PIECEWISE key, padding the count to the
        smallest captured size; modes in ``invalid_modes`` are skipped.

        Args:
            num_tokens: the step's tokens, at least 0.
            uniform_decode: every request has ``uniform_decode_query_len``
                tokens.
            num_active_loras: the step's active adapters, at most its
                requests.
            invalid_modes: graph modes turned off for this step (a frozenset
                of PIECEWISE and FULL).

        Returns:
            The graph's ``Dispatch``, or ``(NONE, BatchDescriptor(num_tokens))``
            where the batch has none (0 tokens, above the largest size, too
            many adapters, its modes turned off).

        Raises:
            ValueError: a bad argument, naming it; a uniform decode batch
                whose ``num_tokens`` is not a multiple of
                ``uniform_decode_query_len`` (its requests all have that many
                tokens), or whose requests exceed ``max_num_seqs``.
        """
        decision = self.route(
            num_tokens,
            uniform_decode=uniform_decode,
            num_active_loras=num_active_loras,
            invalid_modes=invalid_modes,
        )
        return (
            decision if isinstance(decision, Dispatch) else Dispatch(_NONE, BatchDescriptor(int(num_tokens)))
        )

    def route(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
    ) -> Route:
        """``dispatch`` for a step path: one table look-up, nothing built; arguments by position too.

        Args:
            num_tokens: as ``dispatch``'s.
            uniform_decode: as ``dispatch``'s.
            num_active_loras: as ``dispatch``'s.
            invalid_modes: as ``dispatch``'s.

        Returns:
            The graph's ``Dispatch`` (FULL or PIECEWISE), else the
            ``EagerReason`` stored beside the decisions (0 tokens:
            ``EMPTY_BATCH``).

        Raises:
            ValueError: what ``dispatch`` refuses.
        """
        # One test accepts the usual arguments (the uniform and adapter bounds cost a mixed step without
        # adapters nothing); anything else goes the slow way, which names what is wrong or normalizes it.
        tables = self._tables.get(invalid_modes) if invalid_modes.__class__ is frozenset else None
        flag: object = uniform_decode
        if (
            tables is None
            or num_tokens.__class__ is not int
            or num_tokens < 0
            or num_active_loras.__class__ is not int
            or (
                num_active_loras != 0
                and (not 0 < num_active_loras <= num_tokens or num_active_loras > self._max_num_seqs)
            )
            or (
                flag is not False
                and (
                    flag is not True
                    or num_tokens % self._uniform_decode_query_len
                    or not num_active_loras * self._uniform_decode_query_len
                    <= num_tokens
                    <= self._max_uniform_tokens
                )
            )
        ):
            return self._route_checked(num_tokens, flag, num_active_loras, invalid_modes)
        lora_case = bisect_left(self._lora_cases, num_active_loras) if num_active_loras else 0
        return tables[lora_case][uniform_decode][
            self._dense_buckets[num_tokens]
            if num_tokens < self._num_dense_buckets
            else bisect_left(self._bounds, num_tokens)
        ]

    def explain(
        self,
        num_tokens: int,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
    ) -> str:
        """Why ``dispatch`` with these arguments decides what it does, in words (for errors and logs).

        Args:
            num_tokens: as ``dispatch``'s.
            uniform_decode: as ``dispatch``'s.
            num_active_loras: as ``dispatch``'s.
            invalid_modes: as ``dispatch``'s.

        Returns:
            One sentence: the decision and the rule that made it.

        Raises:
            ValueError: what ``dispatch`` refuses.
        """
        request = self._request(num_tokens, uniform_decode, num_active_loras, invalid_modes)
        decision, why = self._rule.decide(
            request.num_tokens, request.uniform_decode, request.num_active_loras, request.invalid_modes
        )
        skipped = request.invalid_modes
        return why.format(
            num_tokens=request.num_tokens,
            num_active_loras=request.num_active_loras,
            decision=decision,
            largest_size=self._config.capture_sizes.max,
            largest_lora_count=self._lora_cases[-1],
            config_mode=self._config.mode.name,
            batch_kind="uniform decode" if request.uniform_decode else "mixed",
            skipped=f" with invalid_modes {sorted(m.name for m in skipped)}" if skipped else "",
        )

    def _route_checked(
        self, num_tokens: object, uniform_decode: object, num_active_loras: object, invalid_modes: object
    ) -> Route:
        """``route`` of arguments its fast test refused: ``ValueError`` naming a bad one, else normalized."""
        request = self._request(num_tokens, uniform_decode, num_active_loras, invalid_modes)
        return self.route(
            request.num_tokens, request.uniform_decode, request.num_active_loras, request.invalid_modes
        )

    def _request(
        self, num_tokens: object, uniform_decode: object, num_active_loras: object, invalid_modes: object
    ) -> RankRequest:
        """The arguments of ``dispatch`` checked against this config: ``ValueError`` naming a bad one."""
        request = RankRequest(num_tokens, uniform_decode, num_active_loras, invalid_modes)  # type: ignore[arg-type]  # checked there
        if request.uniform_decode:
            self._check_uniform(request.num_tokens, request.num_active_loras)
        if request.num_active_loras > self._max_num_seqs:
            raise ValueError(
                f"num_active_loras: {request.num_active_loras} active adapters, above "
                f"max_num_seqs={self._max_num_seqs} (a request runs one adapter; no step has more requests)"
            )
        return request

    def _check_uniform(self, num_tokens: int, num_active_loras: int) -> None:
        """``ValueError`` where a uniform decode batch cannot be one: its requests all have q tokens.

        More requests than ``max_num_seqs`` is a scheduler's bug, not a batch
        to run some other way: it is refused, never routed to a mixed graph.
        """
        q = self._uniform_decode_query_len
        if num_tokens % q:
            raise ValueError(
                f"num_tokens: a uniform decode batch has a multiple of uniform_decode_query_len={q} "
                f"tokens (each request has {q}), got {num_tokens}"
            )
        if num_tokens > self._max_uniform_tokens:
            raise ValueError(
                f"num_tokens: a uniform decode batch of {num_tokens} tokens is {num_tokens // q} requests "
                f"(num_reqs = num_tokens / uniform_decode_query_len={q}), "
                f"above max_num_seqs={self._max_num_seqs}"
            )
        if num_active_loras * q > num_tokens:
            raise ValueError(
                f"num_active_loras: {num_active_loras} active adapters for a uniform decode batch of "
                f"{num_tokens // q} requests ({num_tokens} tokens); a request runs one adapter"
            )

    def capture_plan(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What to capture: the PIECEWISE group, then FULL, each largest first."""
        plan: list[tuple[CUDAGraphMode, list[BatchDescriptor]]] = []
        for mode in (_PIECEWISE, _FULL):
            keys = sorted(self._keys.get(mode, ()), key=_largest_first)
            if keys:
                plan.append((mode, keys))
        return plan


def _resolved(
    config: DispatchConfig, attention: AttentionSupport | None, strict_attention: bool
) -> ModeResolution:
    """The dispatcher's arguments checked (``ValueError`` naming a bad one), and ``config.mode`` resolved."""
    given: object = config  # checked at run time: callers may not be typed
    if not isinstance(given, DispatchConfig):
        raise ValueError(f"config: expected a DispatchConfig, got {config!r}")
    given_attention: object = attention
    if given_attention is not None and not isinstance(given_attention, AttentionSupport):
        raise ValueError(f"attention: expected an AttentionSupport or None, got {attention!r}")
    check_bool("strict_attention", strict_attention)  # resolve_mode would name its own "strict"
    support = AttentionSupport() if attention is None else attention
    return resolve_mode(config, support, strict=strict_attention)


def _largest_first(key: BatchDescriptor) -> tuple[int, int, int, bool]:
    return (-key.num_tokens, -key.num_active_loras, -(key.num_reqs or 0), not key.uniform)


def _asks_for_decode_graphs(config: DispatchConfig) -> bool:
    """Whether ``config``'s mode gives uniform decode batches FULL graphs of their own."""
    return config.mode.decode_mode() is _FULL and config.mode.separate_routine()
