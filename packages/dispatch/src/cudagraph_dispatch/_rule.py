"""The dispatch rule: one batch's decision, and why, over the graphs of one config.

``DispatchRule.decide`` is the one statement of the rules (docs/design.md,
"Dispatch"); ``DispatchRule.tables`` holds its decision for every padding
bucket, which the dispatcher's per-step path reads.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from typing import Final, NamedTuple

from ._config import DispatchConfig
from ._descriptor import BatchDescriptor
from ._modes import CUDAGraphMode
from ._reasons import EagerReason
from ._request import GRAPH_MODES, NO_MODES

_NONE: Final = CUDAGraphMode.NONE
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
_FULL: Final = CUDAGraphMode.FULL
#: Every value ``invalid_modes`` may take; each gets its tables up front, so a
#: first step with cascade attention (FULL invalid) does not build anything.
INVALID_MODE_SETS: Final = (NO_MODES, frozenset({_PIECEWISE}), frozenset({_FULL}), GRAPH_MODES)


class Dispatch(NamedTuple):
    """A dispatch decision: run ``mode`` with the graph keyed ``descriptor``.

    For ``NONE`` the descriptor carries the real, unpadded token count.
    Unchecked on purpose: a ``NamedTuple`` the dispatcher builds from its own
    tables on every step; nothing of ours takes one from a caller.

    Attributes:
        mode: the runtime mode: NONE, PIECEWISE or FULL.
        descriptor: the graph's key (for NONE, the batch's own count).
    """

    mode: CUDAGraphMode
    descriptor: BatchDescriptor


#: What ``route`` returns: the graph to replay (a ``Dispatch`` is always FULL or
#: PIECEWISE), or why there is none (an empty batch's is ``EMPTY_BATCH``).
Route = Dispatch | EagerReason

# Why the rule decided as it did: templates that ``explain`` fills in with the
# batch's own figures. The rule returns one with every decision, so the words
# and the decision come from the same branch; a constant costs nothing while
# the tables are built.
WHY_CONFIG_NONE: Final = "the config's mode is NONE"
WHY_EMPTY: Final = "an empty batch has no graph"
WHY_ABOVE_SIZES: Final = "{num_tokens} tokens exceed the largest capture size {largest_size}"
WHY_ABOVE_LORAS: Final = (
    "num_active_loras={num_active_loras} exceeds the largest captured count {largest_lora_count}"
)
WHY_NO_GRAPH: Final = "mode {config_mode} has no graph for a {batch_kind} batch{skipped}"
WHY_GRAPH: Final = "{num_tokens} tokens replay the {decision.mode.name} graph {decision.descriptor}"

# What the rule decides for one batch, and why: the decision, or the reason
# to run eagerly with the count as given (that Dispatch is built per call, as
# it carries the count), and one of the WHY_ templates. A plain tuple:
# building the tables takes thousands.
Verdict = tuple[Route, str]

# Decisions of one (invalid modes, LoRA case, uniformity), indexed by padding
# bucket; the reason where the batch runs eagerly with its own count.
Row = tuple[Route, ...]
# Indexed [LoRA case][uniform_decode]; one more LoRA case than captured, for counts above them all.
Tables = tuple[tuple[Row, Row], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class LoraCaseGraphs:
    """The graphs of one LoRA case, as the decisions that replay them (built once, shared by all tables)."""

    uniform_decode: tuple[Dispatch, ...]  # FULL uniform decode graphs, one per decode size, ascending
    # The graphs of mixed batches, one per capture size, ascending; empty unless
    # the config's mixed mode is FULL (exact keys) or PIECEWISE (relaxed keys).
    mixed_full: tuple[Dispatch, ...]
    mixed_piecewise: tuple[Dispatch, ...]


class DispatchRule:
    """The graphs a config asks for, one per key, and the rule that picks one for a batch."""

    __slots__ = ("config", "decode_sizes", "graphs", "keys", "lora_cases", "mode", "sizes")

    def __init__(self, config: DispatchConfig) -> None:
        self.config: Final = config
        self.mode: Final = config.mode
        self.sizes: Final = config.capture_sizes.sizes
        #: 0, then the config's LoRA counts: the adapter counts that have graphs.
        self.lora_cases: Final = (0, *config.lora_counts)
        self.decode_sizes: Final = _decode_sizes(config)
        #: The graphs of each LoRA case, in the order of ``lora_cases``.
        self.graphs: Final = tuple(_lora_case_graphs(config, self.decode_sizes, n) for n in self.lora_cases)
        #: The keys of every graph by runtime mode; modes without a graph are left out.
        self.keys: Final = _keys_by_mode(self.graphs)

    def decide(
        self,
        num_tokens: int,
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> Verdict:
        """The dispatch rules for one checked batch (docs/design.md, "Dispatch"): the decision, and why.

        Returns the ``Dispatch`` of a graph, or the ``EagerReason`` there is
        none, with the ``WHY_`` template that words it.
        """
        if num_tokens == 0:  # first: an empty batch is idle in every mode
            return EagerReason.EMPTY_BATCH, WHY_EMPTY
        if self.mode is _NONE:
            return EagerReason.NO_GRAPH_FOR_BATCH, WHY_CONFIG_NONE
        if num_tokens > self.sizes[-1]:
            return EagerReason.ABOVE_LARGEST_SIZE, WHY_ABOVE_SIZES
        # LoRA: the smallest captured count that holds the active adapters.
        lora_case = bisect_left(self.lora_cases, num_active_loras) if num_active_loras else 0
        if lora_case == len(self.lora_cases):
            return EagerReason.LORA_COUNT, WHY_ABOVE_LORAS
        graphs = self.graphs[lora_case]
        graph = self._graph_for(graphs, num_tokens, uniform_decode, invalid_modes)
        if graph is not None:
            return graph, WHY_GRAPH
        if invalid_modes and self._graph_for(graphs, num_tokens, uniform_decode, NO_MODES) is not None:
            return EagerReason.INVALID_MODES, WHY_NO_GRAPH  # a graph the step's invalid_modes turned off
        return EagerReason.NO_GRAPH_FOR_BATCH, WHY_NO_GRAPH

    def _graph_for(
        self,
        graphs: LoraCaseGraphs,
        num_tokens: int,
        uniform_decode: bool,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> Dispatch | None:
        """The first of the uniform FULL, exact FULL and relaxed PIECEWISE graphs not turned off, or None."""
        if uniform_decode and _FULL not in invalid_modes:
            # The smallest decode size that holds it.
            decode_index = bisect_left(self.decode_sizes, num_tokens)
            if decode_index < len(graphs.uniform_decode):
                return graphs.uniform_decode[decode_index]
        size_index = bisect_left(self.sizes, num_tokens)  # the smallest capture size that holds it
        if graphs.mixed_full and _FULL not in invalid_modes:
            return graphs.mixed_full[size_index]
        if graphs.mixed_piecewise and _PIECEWISE not in invalid_modes:
            return graphs.mixed_piecewise[size_index]
        return None

    def all_tables(self) -> dict[frozenset[CUDAGraphMode], Tables]:
        """``tables(invalid_modes)`` for every set of invalid modes a step may pass, sharing equal rows."""
        mixed_rows: dict[tuple[int, bool, bool], Row] = {}
        return {invalid: self.tables(invalid, mixed_rows) for invalid in INVALID_MODE_SETS}

    def tables(
        self, invalid_modes: frozenset[CUDAGraphMode], mixed_rows: dict[tuple[int, bool, bool], Row]
    ) -> Tables:
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
        counts = self.config.capture_sizes.representatives()
        decode_buckets = bisect_left(counts, self.decode_sizes[-1]) + 1 if self.decode_sizes else 0
        decide = self.decide
        tables: list[tuple[Row, Row]] = []
        for case, lora_count in enumerate((*self.lora_cases, self.lora_cases[-1] + 1)):
            graphs = self.graphs[case] if case < len(self.graphs) else None
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


def why_no_keys(config: DispatchConfig) -> str:
    """Why a config plans no uniform decode graph (FULL_DECODE_ONLY: no graph at all, every step eager)."""
    q = config.uniform_decode_query_len
    return (
        f"no capture size in {list(config.capture_sizes.sizes)} is a multiple of uniform_decode_query_len="
        f"{q} within [{q}, {q * config.max_num_seqs}] (q to q * max_num_seqs)"
        + ("; every step will run eagerly" if config.mode is CUDAGraphMode.FULL_DECODE_ONLY else "")
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
) -> LoraCaseGraphs:
    """Every graph the config asks for with ``num_active_loras`` adapters, as decisions."""
    has_lora = num_active_loras > 0
    q = config.uniform_decode_query_len
    max_num_seqs = config.max_num_seqs
    sizes = config.capture_sizes.sizes
    mixed_mode = config.mode.mixed_mode()
    return LoraCaseGraphs(
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


def _keys_by_mode(graphs: tuple[LoraCaseGraphs, ...]) -> dict[CUDAGraphMode, frozenset[BatchDescriptor]]:
    """The keys of every graph, grouped by runtime mode; modes without a graph are left out."""
    full = frozenset(
        graph.descriptor for case in graphs for graph in (*case.uniform_decode, *case.mixed_full)
    )
    piecewise = frozenset(graph.descriptor for case in graphs for graph in case.mixed_piecewise)
    return {mode: keys for mode, keys in ((_PIECEWISE, piecewise), (_FULL, full)) if keys}
