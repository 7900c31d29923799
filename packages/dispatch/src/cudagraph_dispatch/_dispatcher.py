"""The dispatcher: the one source of truth for which graphs exist.

Keys are built once from the config; ``dispatch`` answers from tables built
from those keys, so the per-step cost is a few list and dict look-ups.
"""

from __future__ import annotations

import itertools
from typing import Final, NamedTuple, NoReturn

from ._config import DispatchConfig
from ._descriptor import BatchDescriptor
from ._modes import CUDAGraphMode
from ._sizes import CaptureSizes

_NONE: Final = CUDAGraphMode.NONE
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
_FULL: Final = CUDAGraphMode.FULL
_NO_MODES: Final[frozenset[CUDAGraphMode]] = frozenset()
_INVALIDATABLE: Final = frozenset({_PIECEWISE, _FULL})
_INVALID_SETS: Final = (_NO_MODES, frozenset({_PIECEWISE}), frozenset({_FULL}), _INVALIDATABLE)


class Dispatch(NamedTuple):
    """A dispatch decision: run ``mode`` with the graph keyed ``descriptor``.

    For ``NONE`` the descriptor carries the real, unpadded token count.
    """

    mode: CUDAGraphMode
    descriptor: BatchDescriptor


# Indexed [uniform][LoRA case][n]: the decision for n tokens. Nested tuples, so
# a step's look-up builds no key.
_Table = tuple[tuple[tuple[Dispatch, ...], ...], ...]


class CUDAGraphDispatcher:
    """Maps a batch (token count, uniformity, LoRA count) to a graph key.

    The keys built here are the only graphs that exist: the capture plan
    lists them, and ``dispatch`` only ever returns one of them (or ``NONE``).
    """

    __slots__ = ("_config", "_keys", "_lora_slot", "_max", "_tables")

    def __init__(self, config: DispatchConfig) -> None:
        given: object = config  # checked at run time: callers may not be typed
        if not isinstance(given, DispatchConfig):
            raise ValueError(f"config: expected a DispatchConfig, got {config!r}")
        self._config: Final = config
        self._max: Final = config.capture_sizes.max
        self._keys: Final = _build_keys(config)
        cases = (0, *config.lora_counts)
        # num_active_loras -> index of the smallest captured count that holds it.
        self._lora_slot: Final = tuple(
            next(i for i, c in enumerate(cases) if c >= k) for k in range(cases[-1] + 1)
        )
        # Every set of invalid modes up front: a first step with cascade
        # attention (FULL invalid) must not stall on building its table.
        self._tables: Final[dict[frozenset[CUDAGraphMode], _Table]] = {
            invalid: self._build_tables(invalid) for invalid in _INVALID_SETS
        }

    @property
    def config(self) -> DispatchConfig:
        return self._config

    def keys(self, mode: CUDAGraphMode) -> frozenset[BatchDescriptor]:
        """The keys captured for runtime mode ``mode`` (empty for NONE)."""
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
        invalid_modes: frozenset[CUDAGraphMode] = _NO_MODES,
    ) -> Dispatch:
        """The graph to run ``num_tokens`` tokens with: ``(mode, key)``.

        Tries, in order, the uniform FULL key (``uniform_decode`` only), the
        exact FULL key and the relaxed PIECEWISE key, padding the count to the
        smallest captured size; modes in ``invalid_modes`` are skipped. Falls
        back to ``(NONE, BatchDescriptor(num_tokens))``.
        """
        if num_tokens.__class__ is not int or num_tokens < 0:
            _reject_count("num_tokens", num_tokens)
        if num_active_loras.__class__ is not int or num_active_loras < 0:
            _reject_count("num_active_loras", num_active_loras)
        tables = self._tables.get(invalid_modes) if invalid_modes.__class__ is frozenset else None
        if tables is None:
            _reject_invalid_modes(invalid_modes)
        if num_tokens > self._max or num_active_loras >= len(self._lora_slot):
            return Dispatch(_NONE, BatchDescriptor(num_tokens))
        return tables[1 if uniform_decode else 0][self._lora_slot[num_active_loras]][num_tokens]

    def explain(
        self,
        num_tokens: int,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = _NO_MODES,
    ) -> str:
        """Why ``dispatch`` with these arguments decides what it does, in words (for errors and logs)."""
        decision = self.dispatch(
            num_tokens,
            uniform_decode=uniform_decode,
            num_active_loras=num_active_loras,
            invalid_modes=invalid_modes,
        )
        if decision.mode is not _NONE:
            return f"{num_tokens} tokens replay the {decision.mode.name} graph {decision.descriptor}"
        config = self._config
        if config.mode is _NONE:
            return "the config's mode is NONE"
        if num_tokens == 0:
            return "an empty batch has no graph"
        if num_tokens > self._max:
            return f"{num_tokens} tokens exceed the largest capture size {self._max}"
        if num_active_loras >= len(self._lora_slot):
            return (
                f"num_active_loras={num_active_loras} exceeds the largest captured count "
                f"{len(self._lora_slot) - 1}"
            )
        kind = "uniform decode" if uniform_decode else "mixed"
        skipped = f" with invalid_modes {sorted(m.name for m in invalid_modes)}" if invalid_modes else ""
        return f"mode {config.mode.name} has no graph for a {kind} batch{skipped}"

    def capture_plan(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What to capture: the PIECEWISE group, then FULL, each largest first."""
        plan: list[tuple[CUDAGraphMode, list[BatchDescriptor]]] = []
        for mode in (_PIECEWISE, _FULL):
            keys = sorted(self._keys.get(mode, ()), key=_largest_first)
            if keys:
                plan.append((mode, keys))
        return plan

    # -- table construction (once per config and set of invalid modes) --

    def _build_tables(self, invalid_modes: frozenset[CUDAGraphMode]) -> _Table:
        none: frozenset[BatchDescriptor] = frozenset()
        full = none if _FULL in invalid_modes else self._keys.get(_FULL, none)
        piecewise = none if _PIECEWISE in invalid_modes else self._keys.get(_PIECEWISE, none)
        config = self._config
        pad = config.capture_sizes.pad
        decode = sorted({k.num_tokens for k in full if k.uniform})
        decode_pad = CaptureSizes(decode).pad if decode else _no_size
        rows: dict[tuple[bool, int], tuple[Dispatch, ...]] = {}
        for uniform, loras in itertools.product((False, True), (0, *config.lora_counts)):
            row = [Dispatch(_NONE, BatchDescriptor(0))]
            # A graph decision depends on n only through its padded sizes: resolve
            # each pair once, so all counts padded to one graph share one Dispatch.
            graphs: dict[tuple[int | None, int | None], Dispatch] = {}
            for n in range(1, self._max + 1):
                padded = (pad(n), decode_pad(n))
                decision = graphs.get(padded)
                if decision is None:
                    decision = _resolve(n, uniform, loras, *padded, config, full, piecewise)
                    if decision.mode is not _NONE:
                        graphs[padded] = decision
                row.append(decision)
            rows[(uniform, loras)] = tuple(row)
        cases = (0, *config.lora_counts)
        return tuple(tuple(rows[(uniform, loras)] for loras in cases) for uniform in (False, True))


def _no_size(n: int) -> None:
    """Padding when there are no sizes to pad to."""


def _resolve(
    n: int,
    uniform: bool,
    loras: int,
    padded: int | None,
    decode_padded: int | None,
    config: DispatchConfig,
    full: frozenset[BatchDescriptor],
    piecewise: frozenset[BatchDescriptor],
) -> Dispatch:
    """The decision for one (count, uniformity, LoRA case): see ``dispatch``."""
    has_lora = loras > 0
    if uniform and decode_padded is not None:
        key = _uniform_key(decode_padded, config.uniform_decode_query_len, loras)
        if key in full:
            return Dispatch(_FULL, key)
    if padded is not None:
        key = BatchDescriptor(padded, min(padded, config.max_num_seqs), False, has_lora, loras)
        if key in full:
            return Dispatch(_FULL, key)
        relaxed = key.relaxed()
        if relaxed in piecewise:
            return Dispatch(_PIECEWISE, relaxed)
    return Dispatch(_NONE, BatchDescriptor(n))


def _uniform_key(num_tokens: int, query_len: int, loras: int) -> BatchDescriptor:
    return BatchDescriptor(num_tokens, num_tokens // query_len, True, loras > 0, loras)


def _build_keys(config: DispatchConfig) -> dict[CUDAGraphMode, frozenset[BatchDescriptor]]:
    """Every graph the config asks for, grouped by runtime mode."""
    mode = config.mode
    keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {_PIECEWISE: set(), _FULL: set()}
    if mode is _NONE:
        return {}
    lora_cases = (0, *config.lora_counts)
    mixed = mode.mixed_mode()
    if mixed is not _NONE:
        for size, loras in itertools.product(config.capture_sizes.sizes, lora_cases):
            exact = BatchDescriptor(size, min(size, config.max_num_seqs), False, loras > 0, loras)
            keys[mixed].add(exact if mixed is _FULL else exact.relaxed())
    if mode.decode_mode() is _FULL and mode.separate_routine():
        q = config.uniform_decode_query_len
        for size, loras in itertools.product(config.capture_sizes.sizes, lora_cases):
            if size % q == 0 and q <= size <= q * config.max_num_seqs:
                keys[_FULL].add(_uniform_key(size, q, loras))
    return {m: frozenset(k) for m, k in keys.items() if k}


def _largest_first(key: BatchDescriptor) -> tuple[int, int, int, bool]:
    return (-key.num_tokens, -key.num_active_loras, -(key.num_reqs or 0), not key.uniform)


def _reject_invalid_modes(invalid_modes: object) -> NoReturn:
    raise ValueError(f"invalid_modes: expected a frozenset of PIECEWISE and FULL, got {invalid_modes!r}")


def _reject_count(field: str, value: object) -> None:
    raise ValueError(f"{field}: expected an integer >= 0, got {value!r}")
