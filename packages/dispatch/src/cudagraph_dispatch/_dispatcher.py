"""The dispatcher: the one source of truth for which graphs exist.

The graphs are built once from the config. One rule function, ``_decide``,
states the dispatch rules (docs/design.md, "Dispatch") for one batch and returns the decision with
the reason for it. ``dispatch`` answers from tables filled by calling that
rule once per padding bucket of the capture sizes (every count in a bucket pads
to the same graphs, so it gets the same decision); ``explain`` calls the rule
itself and words its reason. The tables grow with the number of capture
sizes, never with the largest size.
"""

from __future__ import annotations

import dataclasses
import logging
from bisect import bisect_left
from typing import Final, NamedTuple

from ._checks import check_bool
from ._config import DispatchConfig
from ._descriptor import BatchDescriptor
from ._modes import CUDAGraphMode
from ._reasons import EagerReason
from ._request import GRAPH_MODES, NO_MODES, StepRequest
from ._support import AttentionSupport, ModeResolution, resolve_mode

_LOG: Final = logging.getLogger("cudagraph_dispatch")

_NONE: Final = CUDAGraphMode.NONE
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
_FULL: Final = CUDAGraphMode.FULL
#: Every value ``invalid_modes`` may take; each gets its tables up front, so a
#: first step with cascade attention (FULL invalid) does not build anything.
_INVALID_MODE_SETS: Final = (NO_MODES, frozenset({_PIECEWISE}), frozenset({_FULL}), GRAPH_MODES)


class Dispatch(NamedTuple):
    """A dispatch decision: run ``mode`` with the graph keyed ``descriptor``.

    For ``NONE`` the descriptor carries the real, unpadded token count.
    """

    mode: CUDAGraphMode
    descriptor: BatchDescriptor


# Why the rule decided as it did: templates that ``explain`` fills in with the
# batch's own figures. The rule returns one with every decision, so the words
# and the decision come from the same branch; a constant costs nothing while
# the tables are built.
_WHY_CONFIG_NONE: Final = "the config's mode is NONE"
_WHY_EMPTY: Final = "an empty batch has no graph"
_WHY_ABOVE_SIZES: Final = "{num_tokens} tokens exceed the largest capture size {largest_size}"
_WHY_ABOVE_LORAS: Final = (
    "num_active_loras={num_active_loras} exceeds the largest captured count {largest_lora_count}"
)
_WHY_NO_GRAPH: Final = "mode {config_mode} has no graph for a {batch_kind} batch{skipped}"
_WHY_GRAPH: Final = "{num_tokens} tokens replay the {decision.mode.name} graph {decision.descriptor}"


# What the rule decides for one batch, and why: the decision, or the reason
# to run eagerly with the count as given (that Dispatch is built per call, as
# it carries the count), and one of the _WHY_ templates. A plain tuple:
# building the tables takes thousands.
_Verdict = tuple[Dispatch | EagerReason, str]

#: What ``route`` returns: the graph to replay (a ``Dispatch`` is always FULL or
#: PIECEWISE), or why there is none (an empty batch's is ``EMPTY_BATCH``).
Route = Dispatch | EagerReason


@dataclasses.dataclass(frozen=True, slots=True)
class _LoraCaseGraphs:
    """The graphs of one LoRA case, as the decisions that replay them (built once, shared by all tables)."""

    uniform_decode: tuple[Dispatch, ...]  # FULL uniform decode graphs, one per decode size, ascending
    # The graphs of mixed batches, one per capture size, ascending; empty unless
    # the config's mixed mode is FULL (exact keys) or PIECEWISE (relaxed keys).
    mixed_full: tuple[Dispatch, ...]
    mixed_piecewise: tuple[Dispatch, ...]


# Decisions of one (invalid modes, LoRA case, uniformity), indexed by padding
# bucket; the reason where the batch runs eagerly with its own count.
_Row = tuple[Route, ...]
# Indexed [LoRA case][uniform_decode]; one more LoRA case than captured, for counts above them all.
_Tables = tuple[tuple[_Row, _Row], ...]


class CUDAGraphDispatcher:
    """Maps a batch (token count, uniformity, LoRA count) to a graph key.

    The keys built here are the only graphs that exist: the capture plan
    lists them, and ``dispatch`` only ever returns one of them (or ``NONE``).
    """

    __slots__ = (
        "_bounds",
        "_config",
        "_decode_sizes",
        "_dense_buckets",
        "_graphs",
        "_keys",
        "_lora_cases",
        "_mode",
        "_num_dense_buckets",
        "_resolution",
        "_sizes",
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
        given: object = config  # checked at run time: callers may not be typed
        if not isinstance(given, DispatchConfig):
            raise ValueError(f"config: expected a DispatchConfig, got {config!r}")
        given_attention: object = attention
        if given_attention is not None and not isinstance(given_attention, AttentionSupport):
            raise ValueError(f"attention: expected an AttentionSupport or None, got {attention!r}")
        check_bool("strict_attention", strict_attention)  # resolve_mode would name its own "strict"
        # The keys follow the mode the attention can serve, never a mode above it.
        self._resolution: Final = resolve_mode(
            config, AttentionSupport() if attention is None else attention, strict=strict_attention
        )
        if self._resolution.downgraded:
            config = dataclasses.replace(config, mode=self._resolution.mode)
        capture_sizes = config.capture_sizes
        self._config: Final = config
        self._mode: Final = config.mode
        self._sizes: Final = capture_sizes.sizes
        self._lora_cases: Final = (0, *config.lora_counts)
        self._uniform_decode_query_len: Final = config.uniform_decode_query_len
        self._decode_sizes: Final = _decode_sizes(config)
        self._graphs: Final = tuple(
            _lora_case_graphs(config, self._decode_sizes, n) for n in self._lora_cases
        )
        self._keys: Final = _keys_by_mode(self._graphs)
        if self._mode is not _NONE and not self._keys:  # a config that asks for graphs and gets none
            _LOG.warning(
                "CUDA graph mode %s plans no graph: %s",
                self._mode.name,
                _why_no_keys(config),
            )
        # The count -> padding bucket look-up of the capture sizes, held here so
        # that dispatch reaches it without a call.
        self._bounds: Final = capture_sizes.bounds
        self._dense_buckets: Final = capture_sizes.dense_buckets
        self._num_dense_buckets: Final = len(capture_sizes.dense_buckets)
        mixed_rows: dict[tuple[int, bool, bool], _Row] = {}  # shared by the sets of invalid modes
        self._tables: Final[dict[frozenset[CUDAGraphMode], _Tables]] = {
            invalid: self._build_tables(invalid, mixed_rows) for invalid in _INVALID_MODE_SETS
        }

    @property
    def config(self) -> DispatchConfig:
        """The configuration the graphs were built from: its mode is the resolved one."""
        return self._config

    @property
    def resolution(self) -> ModeResolution:
        """The configured mode resolved against the attention's support, and why it was downgraded."""
        return self._resolution

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
        invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
    ) -> Dispatch:
        """The graph to run ``num_tokens`` tokens with: ``(mode, key)``.

        Tries, in order, the uniform FULL key (``uniform_decode`` only), the
        exact FULL key and the relaxed PIECEWISE key, padding the count to the
        smallest captured size; modes in ``invalid_modes`` are skipped. Falls
        back to ``(NONE, BatchDescriptor(num_tokens))``. A bad argument raises
        ``ValueError`` naming it; so does a uniform decode batch whose
        ``num_tokens`` is not a multiple of ``uniform_decode_query_len`` (its
        requests all have that many tokens).
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
        """``dispatch`` for a runner's step path: the graph's decision, or why the batch has none.

        Returns the ``Dispatch`` of a graph (its mode FULL or PIECEWISE, never
        NONE), else the ``EagerReason`` stored beside the decisions
        (``EMPTY_BATCH`` for 0 tokens): nothing is built per call. The same
        checks as ``dispatch``; the arguments may also be passed by position
        (a step path saves the keywords).
        """
        # Runs every step: one test accepts the usual arguments (plain ints,
        # a real bool, one of the four frozensets, a uniform count that is a
        # multiple of q: a mixed step pays nothing for that one); anything
        # else goes the slow way, which names what is wrong or normalizes it.
        tables = self._tables.get(invalid_modes) if invalid_modes.__class__ is frozenset else None
        flag: object = uniform_decode
        if (
            tables is None
            or num_tokens.__class__ is not int
            or num_tokens < 0
            or num_active_loras.__class__ is not int
            or num_active_loras < 0
            or (flag is not False and (flag is not True or num_tokens % self._uniform_decode_query_len))
        ):
            request = self._request(num_tokens, flag, num_active_loras, invalid_modes)
            return self.route(
                request.num_tokens,
                uniform_decode=request.uniform_decode,
                num_active_loras=request.num_active_loras,
                invalid_modes=request.invalid_modes,
            )
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
        """Why ``dispatch`` with these arguments decides what it does, in words (for errors and logs)."""
        request = self._request(num_tokens, uniform_decode, num_active_loras, invalid_modes)
        decision, why = self._decide(
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

    def _request(
        self, num_tokens: object, uniform_decode: object, num_active_loras: object, invalid_modes: object
    ) -> StepRequest:
        """The arguments of ``dispatch`` checked against this config: ``ValueError`` naming a bad one."""
        request = StepRequest(num_tokens, uniform_decode, num_active_loras, invalid_modes)  # type: ignore[arg-type]  # checked there
        q = self._uniform_decode_query_len
        if request.uniform_decode and request.num_tokens % q:
            raise ValueError(
                f"num_tokens: a uniform decode batch has a multiple of uniform_decode_query_len={q} "
                f"tokens (each request has {q}), got {request.num_tokens}"
            )
        return request

    def capture_plan(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What to capture: the PIECEWISE group, then FULL, each largest first."""
        plan: list[tuple[CUDAGraphMode, list[BatchDescriptor]]] = []
        for mode in (_PIECEWISE, _FULL):
            keys = sorted(self._keys.get(mode, ()), key=_largest_first)
            if keys:
                plan.append((mode, keys))
        return plan

    def _decide(
        self,
        num_tokens: int,
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> _Verdict:
        """The dispatch rules for one batch (docs/design.md, "Dispatch"): the decision, and why.

        The only statement of the rules: ``dispatch``'s tables hold its
        decisions and ``explain`` words its reasons.
        """
        sizes = self._sizes
        if num_tokens == 0:  # first: an empty batch is idle in every mode
            return EagerReason.EMPTY_BATCH, _WHY_EMPTY
        if self._mode is _NONE:
            return EagerReason.NO_GRAPH_FOR_BATCH, _WHY_CONFIG_NONE
        if num_tokens > sizes[-1]:
            return EagerReason.ABOVE_LARGEST_SIZE, _WHY_ABOVE_SIZES
        # LoRA: the smallest captured count that holds the active adapters.
        lora_case = bisect_left(self._lora_cases, num_active_loras) if num_active_loras else 0
        if lora_case == len(self._lora_cases):
            return EagerReason.LORA_COUNT, _WHY_ABOVE_LORAS
        graphs = self._graphs[lora_case]
        if uniform_decode and _FULL not in invalid_modes:
            decode_index = bisect_left(
                self._decode_sizes, num_tokens
            )  # the smallest decode size that holds it
            if decode_index < len(graphs.uniform_decode):
                return graphs.uniform_decode[decode_index], _WHY_GRAPH
        size_index = bisect_left(sizes, num_tokens)  # the smallest capture size that holds it
        if graphs.mixed_full and _FULL not in invalid_modes:
            return graphs.mixed_full[size_index], _WHY_GRAPH
        if graphs.mixed_piecewise and _PIECEWISE not in invalid_modes:
            return graphs.mixed_piecewise[size_index], _WHY_GRAPH
        allowed = (
            self._decide(num_tokens, uniform_decode, num_active_loras, NO_MODES) if invalid_modes else None
        )
        if allowed is not None and isinstance(allowed[0], Dispatch):
            return EagerReason.INVALID_MODES, _WHY_NO_GRAPH  # a graph the step's invalid_modes turned off
        return EagerReason.NO_GRAPH_FOR_BATCH, _WHY_NO_GRAPH

    def _build_tables(
        self, invalid_modes: frozenset[CUDAGraphMode], mixed_rows: dict[tuple[int, bool, bool], _Row]
    ) -> _Tables:
        """The rule's decision for every (LoRA case, uniformity, padding bucket) under ``invalid_modes``.

        Each bucket is decided at one count of it (``representatives()``): the
        rule depends on a count only through its padded sizes. The extra
        LoRA case, one above the largest captured count, stands for all
        counts above it. A uniform batch larger than every decode size is
        decided as a mixed one (the rule's fallback), so past the bucket of the
        largest decode size the uniform row repeats the mixed row rather than
        asking the rule again: that keeps the build to about one rule call per
        size and LoRA case. A mixed row is built once for all the sets of
        invalid modes that leave the same mixed graphs (``mixed_rows``): a set
        turns a row's graphs off only where the LoRA case has graphs of that mode.
        """
        counts = self._config.capture_sizes.representatives()
        decode_buckets = bisect_left(counts, self._decode_sizes[-1]) + 1 if self._decode_sizes else 0
        decide = self._decide
        tables: list[tuple[_Row, _Row]] = []
        for case, lora_count in enumerate((*self._lora_cases, self._lora_cases[-1] + 1)):
            graphs = self._graphs[case] if case < len(self._graphs) else None
            key = (
                case,
                graphs is not None and bool(graphs.mixed_full) and _FULL in invalid_modes,
                graphs is not None and bool(graphs.mixed_piecewise) and _PIECEWISE in invalid_modes,
            )
            mixed = mixed_rows.get(key)
            if mixed is None:
                mixed = mixed_rows[key] = tuple(
                    [decide(count, False, lora_count, invalid_modes)[0] for count in counts]
                )
            decode = [decide(count, True, lora_count, invalid_modes)[0] for count in counts[:decode_buckets]]
            tables.append((mixed, (*decode, *mixed[decode_buckets:])))
        return tuple(tables)


def _why_no_keys(config: DispatchConfig) -> str:
    """Why a config whose mode is not NONE plans no graph (only FULL_DECODE_ONLY's sizes can vanish)."""
    q = config.uniform_decode_query_len
    return (
        f"no capture size in {list(config.capture_sizes.sizes)} is a multiple of uniform_decode_query_len="
        f"{q} within [{q}, {q * config.max_num_seqs}] "
        f"(q to q * max_num_seqs); every step will run eagerly"
    )


def _decode_sizes(config: DispatchConfig) -> tuple[int, ...]:
    """The sizes with a uniform decode graph, ascending: multiples of q in ``[q, q * max_num_seqs]``.

    Only modes whose decode batches have a FULL routine of their own have them.
    """
    mode = config.mode
    if mode.decode_mode() is not _FULL or not mode.separate_routine():
        return ()
    q = config.uniform_decode_query_len
    largest = q * config.max_num_seqs
    return tuple(size for size in config.capture_sizes.sizes if size % q == 0 and q <= size <= largest)


def _lora_case_graphs(
    config: DispatchConfig, decode_sizes: tuple[int, ...], num_active_loras: int
) -> _LoraCaseGraphs:
    """Every graph the config asks for with ``num_active_loras`` adapters, as decisions."""
    has_lora = num_active_loras > 0
    q = config.uniform_decode_query_len
    max_num_seqs = config.max_num_seqs
    sizes = config.capture_sizes.sizes
    mixed_mode = config.mode.mixed_mode()
    return _LoraCaseGraphs(
        uniform_decode=tuple(
            Dispatch(_FULL, BatchDescriptor(size, size // q, True, has_lora, num_active_loras))
            for size in decode_sizes
        ),
        mixed_full=tuple(
            Dispatch(_FULL, BatchDescriptor(size, min(size, max_num_seqs), False, has_lora, num_active_loras))
            for size in (sizes if mixed_mode is _FULL else ())
        ),
        mixed_piecewise=tuple(
            Dispatch(_PIECEWISE, BatchDescriptor(size, None, False, has_lora, num_active_loras))
            for size in (sizes if mixed_mode is _PIECEWISE else ())
        ),
    )


def _keys_by_mode(graphs: tuple[_LoraCaseGraphs, ...]) -> dict[CUDAGraphMode, frozenset[BatchDescriptor]]:
    """The keys of every graph, grouped by runtime mode; modes without a graph are left out."""
    full = frozenset(
        graph.descriptor for case in graphs for graph in (*case.uniform_decode, *case.mixed_full)
    )
    piecewise = frozenset(graph.descriptor for case in graphs for graph in case.mixed_piecewise)
    return {mode: keys for mode, keys in ((_PIECEWISE, piecewise), (_FULL, full)) if keys}


def _largest_first(key: BatchDescriptor) -> tuple[int, int, int, bool]:
    return (-key.num_tokens, -key.num_active_loras, -(key.num_reqs or 0), not key.uniform)
